"""Code execution as a tool: model-written Python runs in the bubblewrap sandbox of `sandbox.py` (the
`python` tool of `tools.py`); the environment refuses to start where the sandbox cannot be set up."""

from __future__ import annotations

import re
from typing import Any

from posttrain.environments.answers import grade_reply
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    Turn,
    last_assistant_text,
)
from posttrain.environments.sandbox import sandbox_mode
from posttrain.environments.tools import python_tool

CODE_PATTERN = re.compile(r"<code>(.*?)</code>|```python\n(.*?)```", re.DOTALL)


class CodeToolEnvironment(EnvironmentInterface):
    """A turn with a `<code>...</code>` (or fenced python) block runs it and returns its output as a
    `tool` message; a turn without code is the final answer, graded like the math environment's
    (`answers.grade_reply`: only the answer the turn commits to) against `metadata["ground_truth"]`.
    `max_turns` tool calls end the episode with reward 0.
    """

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
