"""Tool calls as chat models write them: tools declared as OpenAI function schemas, shown to the model
through the chat template's own `tools=` support (or a default system prompt where the template has
none), and calls parsed back out of generated text in the Hermes/Qwen or the Llama-3.1 JSON format."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

END_MARKER_PATTERN = re.compile(r"(\s*(<\|[a-z_]+\|>|<eos>|</s>))+\s*$")


@dataclass
class ToolCall:
    """One well-formed call: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedReply:
    """What a reply holds: its well-formed calls, the reasons its malformed calls are malformed, and the
    text outside any call."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""

    @property
    def has_calls(self) -> bool:
        """The reply tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def strip_end_markers(text: str) -> str:
    """`text` without trailing end-of-turn tokens (`<|im_end|>`, `<|eot_id|>`, `<eos>`, ...)."""
    return END_MARKER_PATTERN.sub("", text)


def _call_from_object(value: Any, arguments_key: str) -> ToolCall:
    """A call from a decoded JSON value `{"name": str, <arguments_key>: object}`; ValueError saying why not.
    Arguments written as a JSON string holding an object are accepted (some models double-encode)."""
    if not isinstance(value, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('a tool call needs a "name" string')
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f'the "{arguments_key}" of {name!r} are not a JSON object') from None
    if not isinstance(arguments, dict):
        raise ValueError(f'the "{arguments_key}" of {name!r} must be a JSON object')
    return ToolCall(name, arguments)


TOO_DEEP = "the call is nested too deeply to decode"
HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply:
    """Hermes/Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them
    anywhere in the reply. A call left open at the end of the reply is malformed."""
    text = strip_end_markers(text)
    reply, outside, position = ParsedReply(), [], 0
    for match in HERMES_CALL.finditer(text):
        outside.append(text[position : match.start()])
        position = match.end()
        if not match.group(2):
            reply.errors.append("<tool_call> is not closed by </tool_call>")
            continue
        try:
            reply.calls.append(_call_from_object(json.loads(match.group(1)), "arguments"))
        except json.JSONDecodeError as error:
            reply.errors.append(f"the call is not valid JSON ({error.msg} at character {error.pos})")
        except RecursionError:
            reply.errors.append(TOO_DEEP)
        except ValueError as error:
            reply.errors.append(str(error))
    reply.content = "".join(outside + [text[position:]]).strip()
    return reply


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedReply:
    """Llama-3.1-style JSON calls: the reply (or its part after `<|python_tag|>`) is a JSON object
    `{"name": ..., "parameters": {...}}`, or several separated by `;`. A reply whose body starts with `{`
    but does not decode is a malformed call; any other reply is plain content."""
    text = strip_end_markers(text)
    before, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        before, body = "", text
    if not body.lstrip().startswith("{"):
        return ParsedReply(content=text.strip())
    reply, decoder, position = ParsedReply(content=before.strip()), json.JSONDecoder(), 0
    while position < len(body):
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
        if position == len(body):
            break
        try:
            value, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError as error:
            reply.errors.append(f"the call is not valid JSON ({error.msg} at character {error.pos})")
            break
        except RecursionError:
            reply.errors.append(TOO_DEEP)
            break
        try:
            reply.calls.append(_call_from_object(value, "parameters"))
        except ValueError as error:
            reply.errors.append(str(error))
    return reply


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of models writes calls: the parser, where generation stops (the end of a call),
    and the instructions of the default tool prompt."""

    parse: Callable[[str], ParsedReply]
    stop_strings: tuple[str, ...]
    instructions: str


TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat(
        parse_hermes,
        ("</tool_call>",),
        'To call a tool, write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call> '
        "and stop; the result comes back in the next message. When you have the answer, reply with it "
        "and no tool call.",
    ),
    "llama3_json": ToolCallFormat(
        parse_llama3_json,
        (),
        'To call a tool, reply with only a JSON object {"name": <tool name>, "parameters": <JSON object>}; '
        "the result comes back in the next message. When you have the answer, reply with it and no JSON.",
    ),
}


def tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_FORMATS:
        raise KeyError(f"unknown tool call format {name!r}; known: {sorted(TOOL_CALL_FORMATS)}")
    return TOOL_CALL_FORMATS[name]


DEFAULT_TOOL_PROMPT = "You can call these tools:\n<tools>\n{tools}\n</tools>\n{instructions}"


def default_tool_prompt(tools: list[dict[str, Any]], format_name: str, template: str | None = None) -> str:
    """The system prompt that declares `tools` to a model whose chat template has no `tools=` support:
    `template` (default `DEFAULT_TOOL_PROMPT`) with `{tools}` replaced by one JSON schema a line and
    `{instructions}` by the format's calling instructions."""
    schemas = "\n".join(json.dumps(tool) for tool in tools)
    instructions = tool_call_format(format_name).instructions
    text = DEFAULT_TOOL_PROMPT if template is None else template
    return text.replace("{tools}", schemas).replace("{instructions}", instructions)


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template reads a `tools` variable (it renders `tools=` itself)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders plain chats
        template = template.get("tool_use") or template.get("default")
    return bool(template) and re.search(r"\btools\b", template) is not None


@dataclass(frozen=True)
class ToolPrompt:
    """The tools one task declares to the model (OpenAI function schemas), their call format, and the
    system prompt template used where the chat template has no `tools=` support (None: the default)."""

    tools: tuple[dict[str, Any], ...]
    format_name: str = "hermes"
    system_prompt: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Where generation stops: the end of a call."""
        return tool_call_format(self.format_name).stop_strings

    def select(self, names: list[str] | None, where: str) -> ToolPrompt:
        """The subset a row names (None: all); an unknown name is a ValueError naming `where`."""
        if names is None:
            return self
        by_name = {tool["function"]["name"]: tool for tool in self.tools}
        unknown = sorted(set(names) - set(by_name))
        if unknown:
            raise ValueError(f"{where} names unknown tool(s) {unknown}; the task's tools: {sorted(by_name)}")
        return ToolPrompt(tuple(by_name[name] for name in names), self.format_name, self.system_prompt)


def add_tool_prompt(
    messages: list[dict[str, Any]], prompt: ToolPrompt, tokenizer: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, chat-template keyword arguments) that declare the tools: `tools=` for a template that
    renders them, else the default tool prompt as (or appended to) the system message."""
    tools = list(prompt.tools)
    if not tools:
        return messages, {}
    if template_supports_tools(tokenizer):
        return messages, {"tools": tools}
    text = default_tool_prompt(tools, prompt.format_name, prompt.system_prompt)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}
