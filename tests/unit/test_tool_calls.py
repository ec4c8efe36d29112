"""Tool-call parsers against hand-written replies in each format (valid, malformed, two calls, text around
calls), and how tools are declared in a prompt: the template's `tools=` or the default system prompt."""

import json

import pytest

from posttrain.data.tool_calls import (
    ToolCall,
    ToolPrompt,
    add_tool_prompt,
    default_tool_prompt,
    parse_hermes,
    parse_llama3_json,
    strip_end_markers,
    template_supports_tools,
)
from posttrain.models.tokenizer import build_char_tokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


# ------------------------------------------------------------------------------------------ Hermes/Qwen
def test_hermes_one_call_with_text_around_it():
    reply = parse_hermes(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n'
        "</tool_call><|im_end|>"
    )
    assert reply.calls == [ToolCall("calculator", {"expression": "123*456"})]
    assert reply.errors == [] and reply.content == "Let me compute."


def test_hermes_two_calls_keep_their_order():
    reply = parse_hermes(
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call> done'
    )
    assert reply.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]  # b's arguments double-encoded
    assert reply.content == "and  done"


def test_hermes_plain_answer_has_no_calls():
    reply = parse_hermes("The answer is 56088.<eos>")
    assert not reply.has_calls and reply.content == "The answer is 56088."


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}', "not closed"),
        ("<tool_call>calculator(1+1)</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>["calculator"]</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"name": "c", "arguments": "not json"}</tool_call>', "not a JSON object"),
    ],
)
def test_hermes_malformed_calls_say_why(text, reason):
    reply = parse_hermes(text)
    assert reply.calls == [] and reply.has_calls
    assert len(reply.errors) == 1 and reason in reply.errors[0]


def test_hermes_a_malformed_call_beside_a_good_one():
    reply = parse_hermes('<tool_call>{oops}</tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert reply.calls == [ToolCall("a", {})] and len(reply.errors) == 1


# ------------------------------------------------------------------------------------- Llama-3.1 JSON
def test_llama3_json_whole_reply_is_a_call():
    reply = parse_llama3_json('{"name": "calculator", "parameters": {"expression": "2**10"}}<|eom_id|>')
    assert reply.calls == [ToolCall("calculator", {"expression": "2**10"})] and reply.content == ""


def test_llama3_json_after_python_tag_with_text_before():
    reply = parse_llama3_json(
        'I will use the calculator.<|python_tag|>{"name": "calculator", "parameters": {"expression": "3*3"}}'
    )
    assert reply.calls == [ToolCall("calculator", {"expression": "3*3"})]
    assert reply.content == "I will use the calculator."


def test_llama3_json_two_calls_separated_by_semicolon():
    reply = parse_llama3_json('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": 2}}')
    assert reply.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})] and reply.errors == []


def test_llama3_json_prose_is_not_a_call():
    reply = parse_llama3_json('The answer is 9. I did not need {"name": ...}.<|eot_id|>')
    assert not reply.has_calls and reply.content == 'The answer is 9. I did not need {"name": ...}.'


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"name": "calculator", "parameters": {"expression": "1+1"}', "not valid JSON"),
        ('{"parameters": {}}', '"name"'),
        ('{"name": "calculator", "parameters": 5}', "must be a JSON object"),
    ],
)
def test_llama3_json_malformed_calls_say_why(text, reason):
    reply = parse_llama3_json(text)
    assert reply.calls == [] and len(reply.errors) == 1 and reason in reply.errors[0]


def test_end_markers_are_stripped_only_at_the_end():
    assert strip_end_markers("a <|im_end|> b<|im_end|>\n") == "a <|im_end|> b"
    assert strip_end_markers("42<eos>") == "42"


# ---------------------------------------------------------------------------------- declaring tools
def test_a_template_without_tools_gets_the_default_system_prompt():
    tokenizer = build_char_tokenizer()
    assert not template_supports_tools(tokenizer)
    messages, kwargs = add_tool_prompt([{"role": "user", "content": "2+2?"}], ToolPrompt((CALC,)), tokenizer)
    assert kwargs == {}
    assert messages[0] == {"role": "system", "content": default_tool_prompt([CALC], "hermes")}
    assert json.dumps(CALC) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]


def test_the_default_prompt_is_appended_to_an_existing_system_message():
    tokenizer = build_char_tokenizer()
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    messages, _ = add_tool_prompt(prompt, ToolPrompt((CALC,), "llama3_json"), tokenizer)
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert '"parameters": <JSON object>' in messages[0]["content"]


def test_a_template_that_renders_tools_gets_them_as_tools_argument():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% if tools %}<|system|>TOOLS:{{ tools | length }}{% endif %}"
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    )
    assert template_supports_tools(tokenizer)
    prompt = [{"role": "user", "content": "2+2?"}]
    messages, kwargs = add_tool_prompt(prompt, ToolPrompt((CALC,)), tokenizer)
    assert messages == prompt and kwargs == {"tools": [CALC]}
    assert tokenizer.apply_chat_template(messages, tokenize=False, **kwargs).startswith("<|system|>TOOLS:1")


def test_a_row_selects_a_subset_and_an_unknown_name_is_named():
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    prompt = ToolPrompt((CALC, other))
    assert prompt.select(["other"], "row 3").tools == (other,)
    assert prompt.select(None, "row 3") is prompt
    with pytest.raises(ValueError, match=r"row 3 names unknown tool\(s\) \['search'\]"):
        prompt.select(["search"], "row 3")
