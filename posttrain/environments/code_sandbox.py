"""Code execution as a tool: model-written Python runs in a separate, limited subprocess.

Limits: wall time (killed at `timeout_s`), address space (`memory_mb`), CPU seconds, a fresh temporary
working directory, output truncated to `max_output_chars`, and no network: an audit hook in the child
refuses every socket operation, and where the kernel allows it the child also gets an empty network
namespace. The code never runs in the trainer's (or the environment actor's) own process.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
    strip_special_tokens,
)
from posttrain.environments.math_env import verify_answer

CODE_PATTERN = re.compile(r"<code>(.*?)</code>|```python\n(.*?)```", re.DOTALL)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000

# Runs first in the child: refuse any socket event before the user's code is even compiled.
NO_NETWORK_PRELUDE = """
import sys
def _refuse_network(event, args):
    if event.startswith("socket.") :
        raise PermissionError("network access is disabled in the posttrain sandbox")
sys.addaudithook(_refuse_network)
del _refuse_network
"""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when killed at the time limit
    timed_out: bool


def _limit_child(memory_mb: int, cpu_seconds: int) -> None:
    """preexec_fn: resource limits and, when permitted, a private empty network namespace."""
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # unprivileged fallback; the audit hook still applies


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000) -> SandboxResult:
    """Run `code` with `python -I` in a temporary directory under the limits above."""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write(NO_NETWORK_PRELUDE + "\n" + code)
        try:
            completed = subprocess.run(
                [sys.executable, "-I", script],
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir},
                capture_output=True,
                text=True,
                timeout=timeout_s,
                preexec_fn=lambda: _limit_child(memory_mb, int(timeout_s) + 1),
            )
        except subprocess.TimeoutExpired as expired:
            return SandboxResult(_text(expired.stdout, max_output_chars), _text(expired.stderr, max_output_chars), None, True)
    return SandboxResult(
        completed.stdout[:max_output_chars], completed.stderr[:max_output_chars], completed.returncode, False
    )


def _text(value: str | bytes | None, limit: int) -> str:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return (value or "")[:limit]


class CodeToolEnvironment(EnvironmentInterface):
    """A turn with a `<code>...</code>` (or fenced python) block runs it and returns its output as a
    `tool` message; a turn without code is the final answer, scored with math-verify against
    `metadata["ground_truth"]`. `max_turns` tool calls end the episode with reward 0.
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000, max_turns: int = 4):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_output_chars, self.max_turns = max_output_chars, max_turns

    def _tool_output(self, code: str) -> str:
        result = run_python(code, self.timeout_s, self.memory_mb, self.max_output_chars)
        if result.timed_out:
            return f"{result.stdout}\n[killed: exceeded {self.timeout_s}s]"
        return result.stdout + (f"\n[stderr]\n{result.stderr}" if result.returncode else "")

    def _step_one(self, log: list[Message], meta: dict[str, Any]) -> tuple[Message, dict, float, bool, str | None, int]:
        text = last_assistant_text(log)
        match = CODE_PATTERN.search(text)
        turns = meta.get("num_tool_calls", 0)
        if match and turns < self.max_turns:
            output = self._tool_output(match.group(1) or match.group(2))
            return {"role": "tool", "content": output}, {**meta, "num_tool_calls": turns + 1}, 0.0, False, None, 0
        try:
            reward, answer = verify_answer(strip_special_tokens(text), str(meta["ground_truth"]))
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
