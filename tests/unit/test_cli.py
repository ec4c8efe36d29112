"""The `posttrain` command: every subcommand is listed and dispatches to its module."""

import subprocess
import sys

from posttrain.cli import COMMANDS


def test_help_lists_every_subcommand():
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for name in ["sft", "grpo", "dpo", "rm", "eval", "demo", "export"]:
        assert name in result.stdout
    assert set(COMMANDS) >= {"sft", "grpo", "dpo", "rm", "eval", "demo", "export"}
