"""Environments of tool calls. The agent loop's (`env.<task>.cls: tools`): each assistant turn either
calls tools, whose results come back as a `tool` message, or gives the final answer, graded strictly
against the ground truth (`answers.grade_reply`: only the answer the reply commits to). Malformed calls,
unknown tools, invalid arguments and failing tools come back to the model as tool errors and are counted.
An episode ends cleanly (reward 0) when it would exceed its tool turns, its tokens or its tool time.
`code` runs `<code>` blocks with the sandboxed `python` tool. Both refuse to start where the sandbox
(`sandbox`) cannot be set up."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.errors import closest
from posttrain.data.tool_calls import ParsedReply, ToolPrompt, tool_call_format
from posttrain.environments.answers import grade_reply
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    Turn,
    last_assistant_text,
)
from posttrain.environments.sandbox import sandbox_mode
from posttrain.environments.tools import Tool, ToolResult, call_tool, python_tool, resolve_tool


@dataclass
class ToolEnvironmentConfig:
    """The keyword arguments of the `tools` environment (`env.<task>.kwargs`)."""

    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """built-in names (calculator, python) or module:function / file.py:function"""
    parameters: dict[str, Any] = field(default_factory=dict)
    """JSON schema of a tool's arguments by tool name (default: inferred)"""
    format: Literal["hermes", "llama3_json"] = "hermes"
    """call format: hermes (Hermes/Qwen tool_call tags) or llama3_json"""
    system_prompt: str | None = None
    """tool prompt for templates without tools= support; {tools} and {instructions} are filled in (None:
    the default)"""
    max_tool_turns: int = 4
    """assistant turns with tool calls per episode"""
    max_episode_tokens: int | None = None
    """tokens of the conversation after which a call ends the episode"""
    max_tool_time_s: float = 30.0
    """seconds of tool time per episode"""
    max_output_chars: int = 2000
    """a tool result is cut to this many characters"""
    python_timeout_s: float = 5.0
    """the python tool's time limit per call"""
    python_memory_mb: int = 512
    """the python tool's memory limit"""
    ground_truth_key: str = "ground_truth"
    """metadata key of the answer"""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> ToolEnvironmentConfig:
        """The config from `env.<task>.kwargs`; an unknown key is an error naming the closest valid one."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                guess = closest(key, names)
                hint = f"; did you mean {guess!r}?" if guess else f"; valid: {names}"
                raise ValueError(f"tools environment: unknown kwarg {key!r}{hint}")
        cfg = cls(**kwargs)
        if not (isinstance(cfg.tools, list | tuple) and all(isinstance(t, str) for t in cfg.tools)):
            raise ValueError(f"tools environment: tools must be a list of names, got {cfg.tools!r}")
        if not isinstance(cfg.parameters, dict):
            raise ValueError(
                f"tools environment: parameters must map tool names to schemas, got {cfg.parameters!r}"
            )
        tool_call_format(cfg.format)
        if cfg.max_tool_turns < 0 or cfg.max_tool_time_s <= 0:
            raise ValueError("tools environment: max_tool_turns must be >= 0 and max_tool_time_s > 0")
        unknown = sorted(set(cfg.parameters) - {spec.rpartition(":")[2] for spec in cfg.tools})
        if unknown:
            raise ValueError(f"tools environment: parameters given for {unknown}, which are not in tools")
        return cfg


def build_tools(cfg: ToolEnvironmentConfig) -> dict[str, Tool]:
    """The configured tools by name; two tools with one name are an error."""
    python_limits = {
        "timeout_s": cfg.python_timeout_s,
        "memory_mb": cfg.python_memory_mb,
        "max_output_chars": cfg.max_output_chars,
    }
    tools: dict[str, Tool] = {}
    for spec in cfg.tools:
        tool = resolve_tool(spec, cfg.parameters.get(spec.rpartition(":")[2]), python_limits)
        if tool.name in tools:
            raise ValueError(f"tools environment: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


COUNTERS = ("tool_calls", "tool_errors", "ended_by_turns", "ended_by_tokens", "ended_by_tool_time")


class ToolEnvironment(EnvironmentInterface):
    """Per-sample metadata: `ground_truth`, optionally `tools` (the names this row may call); kept across
    turns: `num_tool_turns`, `tool_time_s`. Messages carry `num_tokens` (their token count). Counts
    summed over a step (EnvironmentReturn.counts): tool calls, tool errors, episodes ended per limit."""

    ground_truth_kwarg = "ground_truth_key"

    def __init__(self, **kwargs: Any):
        self.cfg = ToolEnvironmentConfig.from_kwargs(kwargs)
        self.call_format = tool_call_format(self.cfg.format)
        self.tools = build_tools(self.cfg)
        if "python" in self.tools:
            sandbox_mode()  # raises SandboxUnavailableError (what is missing) before any code is accepted

    @classmethod
    def tool_prompt(cls, kwargs: dict[str, Any]) -> ToolPrompt:
        cfg = ToolEnvironmentConfig.from_kwargs(kwargs)
        schemas = [tool.schema for tool in build_tools(cfg).values()]
        return ToolPrompt(tuple(schemas), cfg.format, cfg.system_prompt)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        turns = [self._step_isolated(log, dict(meta)) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn.from_turns(turns, COUNTERS)

    def _step_isolated(self, log: list[Message], meta: dict[str, Any]) -> Turn:
        """`_step_one`, except that a sample whose handling raises (e.g. a call nested too deeply for a
        tool's argument check) ends with reward 0 and counts as an error, without touching the others."""
        try:
            return self._step_one(log, meta)
        except Exception as error:
            content = f"environment error: {type(error).__name__}"
            return Turn({"role": "environment", "content": content}, meta, 0.0, True, error=content)

    def _step_one(self, log: list[Message], meta: dict[str, Any]) -> Turn:
        reply = self.call_format.parse(log[-1]["content"] if log and log[-1]["role"] == "assistant" else "")
        if not reply.has_calls:
            reward, answer = grade_reply(reply.content, str(meta.get(self.cfg.ground_truth_key)))
            return Turn({"role": "environment", "content": ""}, meta, reward, True, answer)
        limit = self._limit_reached(log, meta)
        if limit is not None:
            return Turn({"role": "environment", "content": ""}, meta, 0.0, True, counts={limit: 1})
        results = self._run_calls(reply, meta)
        meta["num_tool_turns"] = meta.get("num_tool_turns", 0) + 1
        meta["tool_time_s"] = meta.get("tool_time_s", 0.0) + sum(r.seconds for r in results)
        content = "\n".join(r.content[: self.cfg.max_output_chars] for r in results)
        counts = {"tool_calls": len(results), "tool_errors": sum(r.is_error for r in results)}
        stops = list(self.call_format.stop_strings) or None
        return Turn({"role": "tool", "content": content}, meta, next_stop_strings=stops, counts=counts)

    def _limit_reached(self, log: list[Message], meta: dict[str, Any]) -> str | None:
        """The limit a new tool turn would exceed (a counter name), or None."""
        if meta.get("num_tool_turns", 0) >= self.cfg.max_tool_turns:
            return "ended_by_turns"
        num_tokens = sum(int(m.get("num_tokens", 0)) for m in log)
        if self.cfg.max_episode_tokens is not None and num_tokens >= self.cfg.max_episode_tokens:
            return "ended_by_tokens"
        if meta.get("tool_time_s", 0.0) >= self.cfg.max_tool_time_s:
            return "ended_by_tool_time"
        return None

    def _run_calls(self, reply: ParsedReply, meta: dict[str, Any]) -> list[ToolResult]:
        """One result per call, in order: parse errors first, then each call (unknown tools are errors)."""
        allowed = meta.get("tools")
        results = [ToolResult(f"error: malformed tool call: {error}", True) for error in reply.errors]
        for call in reply.calls:
            tool = self.tools.get(call.name)
            if tool is None or (allowed is not None and call.name not in allowed):
                names = sorted(self.tools if allowed is None else allowed)
                results.append(ToolResult(f"error: unknown tool {call.name!r}; available: {names}", True))
                continue
            budget = self.cfg.max_tool_time_s - meta.get("tool_time_s", 0.0) - sum(r.seconds for r in results)
            result = call_tool(tool, call.arguments, budget)
            results.append(
                dataclasses.replace(result, content="error: " + result.content) if result.is_error else result
            )
        return results


CODE_PATTERN = re.compile(r"<code>(.*?)</code>|```python\n(.*?)```", re.DOTALL)


class CodeToolEnvironment(EnvironmentInterface):
    """A turn with a `<code>...</code>` (or fenced python) block runs it and returns its output as a
    `tool` message; a turn without code is the final answer, graded like the math environment's
    (`answers.grade_reply`: only the answer the turn commits to) against `metadata["ground_truth"]`.
    After `max_turns` tool calls, a turn is the final answer, code or not."""

    ground_truth_kwarg = "ground_truth_key"

    def __init__(
        self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000, max_turns: int = 4
    ):
        self.run_code = python_tool(timeout_s, memory_mb, max_output_chars)
        self.max_turns = max_turns
        sandbox_mode()  # raises SandboxUnavailableError (what is missing) before any code is accepted

    def _step_one(self, log: list[Message], meta: dict[str, Any]) -> Turn:
        text = last_assistant_text(log)
        match = CODE_PATTERN.search(text)
        turns = meta.get("num_tool_calls", 0)
        if match and turns < self.max_turns:
            output = self.run_code(match.group(1) or match.group(2))
            new_meta = {**meta, "num_tool_calls": turns + 1}
            return Turn({"role": "tool", "content": output}, new_meta, next_stop_strings=["</code>"])
        try:
            reward, answer = grade_reply(text, str(meta["ground_truth"]))
        except Exception as error:
            return Turn({"role": "environment", "content": ""}, meta, terminated=True, error=repr(error))
        return Turn({"role": "environment", "content": ""}, meta, reward, True, answer)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        turns = [self._step_one(log, meta) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn.from_turns(turns)
