"""Code execution as a tool: model-written Python runs in the bubblewrap sandbox of `sandbox.py` (no
network, no view of other processes or of files beyond the interpreter's, a dropped uid as root, time,
memory, process, file-size and output limits). The environment refuses to start where the sandbox
cannot be set up.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from posttrain.environments.answers import grade_reply
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)
from posttrain.environments.sandbox import SandboxLimits, SandboxResult, run_python, sandbox_mode

__all__ = ["CodeToolEnvironment", "SandboxResult", "run_python"]

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
        self.limits = SandboxLimits(
            timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_chars
        )
        self.max_turns = max_turns
        sandbox_mode()  # raises SandboxUnavailableError (what is missing) before any code is accepted

    def _tool_output(self, code: str) -> str:
        result = run_python(code, self.limits)
        if result.timed_out:
            return f"{result.stdout}\n[killed: exceeded {self.limits.timeout_s}s]"
        if result.output_truncated:
            return f"{result.stdout}\n[killed: output exceeded {self.limits.max_output_bytes} bytes]"
        return result.stdout + (f"\n[stderr]\n{result.stderr}" if result.returncode else "")

    def _step_one(
        self, log: list[Message], meta: dict[str, Any]
    ) -> tuple[Message, dict, float, bool, str | None, int]:
        text = last_assistant_text(log)
        match = CODE_PATTERN.search(text)
        turns = meta.get("num_tool_calls", 0)
        if match and turns < self.max_turns:
            output = self._tool_output(match.group(1) or match.group(2))
            return (
                {"role": "tool", "content": output},
                {**meta, "num_tool_calls": turns + 1},
                0.0,
                False,
                None,
                0,
            )
        try:
            reward, answer = grade_reply(text, str(meta["ground_truth"]))
            errors = 0
        except Exception:
            reward, answer, errors = 0.0, None, 1
        return {"role": "environment", "content": ""}, meta, reward, True, answer, errors

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        results = [self._step_one(log, meta) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn(
            observations=[r[0] for r in results],
            metadata=[r[1] for r in results],
            next_stop_strings=[None if r[3] else ["</code>"] for r in results],
            rewards=torch.tensor([r[2] for r in results], dtype=torch.float32),
            terminateds=torch.tensor([r[3] for r in results], dtype=torch.bool),
            answers=[r[4] for r in results],
            num_errors=sum(r[5] for r in results),
        )
