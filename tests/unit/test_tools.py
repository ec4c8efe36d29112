"""The tool registry (calculator, user functions from a file, schemas, argument validation, timeouts) and
the `tools` environment's agent loop: calls, errors that go back to the model, grading, limits, counts."""

import pytest

from posttrain.environments import EnvironmentConfig, tool_prompts
from posttrain.environments.tool_env import ToolEnvironment, ToolEnvironmentConfig
from posttrain.environments.tools import (
    calculator,
    call_tool,
    check_arguments,
    make_tool,
    parameters_from_signature,
    resolve_tool,
)

USER_TOOLS = '''
import time


def lookup(city: str, year: int = 2020) -> dict:
    """Population of a city in a year.

    More words that are not the description."""
    return {"city": city, "population": 1000 + year}


def slow(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "done"


def broken() -> str:
    """Always fails."""
    raise RuntimeError("database is down")
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return str(path)


@pytest.mark.parametrize(
    "expression, value",
    [("123 * 456", "56088"), ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"), ("8 / 4", "2"), ("2 ** 10", "1024")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('id')", "unsupported"),
        ("1 / 0", "division by zero"),
        ("9 ** 9999", "exponent"),
        ("1 +", "cannot parse"),
        ("((10**100)**100)**100", "too large"),
    ],
)
def test_calculator_refuses_what_is_not_plain_arithmetic(expression, reason):
    with pytest.raises(ValueError, match=reason):
        calculator(expression)


def test_a_user_function_gets_a_schema_from_its_signature_and_docstring(tools_file):
    tool = resolve_tool(f"{tools_file}:lookup", None, {})
    function = tool.schema["function"]
    assert function["name"] == "lookup" and function["description"] == "Population of a city in a year."
    assert function["parameters"] == {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    assert call_tool(tool, {"city": "Oslo"}, 5.0).content == '{"city": "Oslo", "population": 3020}'


def test_arguments_are_validated_against_the_schema(tools_file):
    tool = resolve_tool(f"{tools_file}:lookup", None, {})
    assert check_arguments(tool, {"city": "Oslo", "year": 1990}) is None
    assert "'city' is a required property" in check_arguments(tool, {})
    assert "at 'year'" in check_arguments(tool, {"city": "Oslo", "year": "last"})
    assert "Additional properties" in check_arguments(tool, {"city": "Oslo", "country": "NO"})
    result = call_tool(tool, {"city": 3}, 5.0)
    assert result.is_error and "invalid arguments for 'lookup' at 'city'" in result.content


def test_a_failing_or_slow_tool_is_an_error_result(tools_file):
    broken = call_tool(resolve_tool(f"{tools_file}:broken", None, {}), {}, 5.0)
    assert broken.is_error and "RuntimeError: database is down" in broken.content
    slow = call_tool(resolve_tool(f"{tools_file}:slow", None, {}), {"seconds": 2.0}, 0.2)
    assert slow.is_error and "timed out after 0.2s" in slow.content and slow.seconds < 1.0


def test_bad_tool_configuration_names_the_culprit(tools_file):
    with pytest.raises(KeyError, match="unknown tool 'calculater'"):
        resolve_tool("calculater", None, {})
    with pytest.raises(AttributeError, match=r"tool '.*my_tools.py:nope': .* has no attribute 'nope'"):
        resolve_tool(f"{tools_file}:nope", None, {})
    with pytest.raises(ValueError, match="tool 'bad': its parameters are not a valid JSON schema"):
        make_tool("bad", calculator, {"type": "objekt"})
    with pytest.raises(ValueError, match="unknown kwarg 'max_turns'; did you mean 'max_tool_turns'"):
        ToolEnvironmentConfig.from_kwargs({"max_turns": 3})
    with pytest.raises(ValueError, match=r"env.math.kwargs: .*unknown tool 'search'"):
        tool_prompts({"math": EnvironmentConfig(cls="tools", kwargs={"tools": ["search"]})})


def test_schema_inference_skips_star_arguments():
    def f(a, *args, b: float = 1.0, **kwargs):
        return a

    assert parameters_from_signature(f)["properties"] == {"a": {}, "b": {"type": "number"}}


# ----------------------------------------------------------------------------------- the environment
def assistant(text, num_tokens=10):
    return {"role": "assistant", "content": text, "num_tokens": num_tokens}


PROMPT = [{"role": "user", "content": "What is 123 * 456?", "num_tokens": 20}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'


def test_a_call_returns_a_tool_message_and_the_final_answer_is_graded():
    env = ToolEnvironment()
    first = env.step([PROMPT + [assistant(CALL)]], [{"ground_truth": "56088"}])
    assert first.observations == [{"role": "tool", "content": "56088"}]
    assert not first.terminateds[0] and first.rewards.tolist() == [0.0]
    assert first.next_stop_strings == [["</tool_call>"]]
    assert first.metadata[0]["num_tool_turns"] == 1
    assert first.counts["tool_calls"] == 1.0 and first.counts["tool_errors"] == 0.0
    log = PROMPT + [assistant(CALL), {"role": "tool", "content": "56088", "num_tokens": 5}]
    for reply, reward in [("The answer is 56088.<|im_end|>", 1.0), ("56088 or 56089", 0.0), ("56,088", 1.0)]:
        final = env.step([log + [assistant(reply)]], first.metadata)
        assert bool(final.terminateds[0]) and final.rewards.tolist() == [reward], reply


def test_malformed_calls_unknown_tools_and_bad_arguments_go_back_as_errors():
    env = ToolEnvironment()
    replies = [
        "<tool_call>calculator(1+1)</tool_call>",
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
    ]
    result = env.step([PROMPT + [assistant(r)] for r in replies], [{"ground_truth": "2"}] * 4)
    contents = [o["content"] for o in result.observations]
    assert contents[0].startswith("error: malformed tool call: the call is not valid JSON")
    assert contents[1] == "error: unknown tool 'search'; available: ['calculator']"
    assert contents[2].startswith("error: invalid arguments for 'calculator'")
    assert contents[3] == "error: tool 'calculator' failed: ValueError: division by zero"
    assert not result.terminateds.any() and result.counts["tool_errors"] == 4.0


def test_a_row_may_only_call_its_own_tools(tools_file):
    env = ToolEnvironment(tools=["calculator", f"{tools_file}:lookup"])
    result = env.step([PROMPT + [assistant(CALL)]], [{"ground_truth": "1", "tools": ["lookup"]}])
    assert result.observations[0]["content"] == "error: unknown tool 'calculator'; available: ['lookup']"


@pytest.mark.parametrize(
    "kwargs, metadata, num_tokens, counter",
    [
        ({"max_tool_turns": 1}, {"num_tool_turns": 1}, 10, "ended_by_turns"),
        ({"max_episode_tokens": 30}, {}, 10, "ended_by_tokens"),
        ({"max_tool_time_s": 1.0}, {"tool_time_s": 1.5}, 10, "ended_by_tool_time"),
    ],
)
def test_each_limit_ends_the_episode_cleanly_with_reward_0(kwargs, metadata, num_tokens, counter):
    env = ToolEnvironment(**kwargs)
    result = env.step([PROMPT + [assistant(CALL, num_tokens)]], [{"ground_truth": "56088", **metadata}])
    assert bool(result.terminateds[0]) and result.rewards.tolist() == [0.0]
    assert result.counts[counter] == 1.0 and result.counts["tool_calls"] == 0.0


def test_two_calls_in_one_turn_give_both_results_in_order():
    env = ToolEnvironment()
    two = CALL + '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    result = env.step([PROMPT + [assistant(two)]], [{"ground_truth": "2"}])
    assert result.observations[0]["content"] == "56088\n2" and result.counts["tool_calls"] == 2.0


def test_llama3_json_format_parses_calls_and_has_no_stop_string():
    env = ToolEnvironment(format="llama3_json")
    call = '{"name": "calculator", "parameters": {"expression": "6*7"}}<|eot_id|>'
    result = env.step([PROMPT + [assistant(call)]], [{"ground_truth": "42"}])
    assert result.observations[0]["content"] == "42" and result.next_stop_strings == [None]


def test_a_bad_tools_kwarg_is_a_config_error_naming_the_key():
    from pathlib import Path

    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.config import ConfigError, load_typed_config

    config = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml")
    tools = ["env.arithmetic.cls=tools", "grpo.max_rollout_turns=2"]
    with pytest.raises(
        ConfigError, match=r"env.arithmetic.kwargs: .*unknown kwarg 'fromat'; did you mean 'format'"
    ):
        load_typed_config(GRPOConfig, config, [*tools, "+env.arithmetic.kwargs.fromat=hermes"])
    with pytest.raises(ConfigError, match=r"env.arithmetic.kwargs: unknown tool call format 'xml'"):
        load_typed_config(GRPOConfig, config, [*tools, "+env.arithmetic.kwargs.format=xml"])
    with pytest.raises(ConfigError, match=r"grpo.max_rollout_turns: env.arithmetic is a tools environment"):
        load_typed_config(GRPOConfig, config, ["env.arithmetic.cls=tools"])


def test_the_python_tool_runs_code_in_the_sandbox():
    from posttrain.environments.sandbox import SandboxUnavailableError

    try:
        env = ToolEnvironment(tools=["python"], python_timeout_s=5.0)
    except SandboxUnavailableError as error:
        pytest.skip(f"no sandbox here: {error}")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 456)"}}</tool_call>'
    result = env.step([PROMPT + [assistant(call)]], [{"ground_truth": "56088"}])
    assert result.observations[0] == {"role": "tool", "content": "56088\n"}
