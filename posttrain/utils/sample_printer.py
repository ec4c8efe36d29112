"""Validation samples: all of them saved to `val_samples/step_N.jsonl`, the best and worst by reward
printed in a rich panel with reward statistics, each message coloured by its role."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

ROLE_STYLES = {
    "system": "magenta",
    "user": "cyan",
    "assistant": "green",
    "tool": "yellow",
    "environment": "yellow",
}


def _json_default(value: Any) -> Any:
    """Tensors and numpy values become plain numbers or lists; anything else its str()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def reward_of(sample: Mapping[str, Any]) -> float:
    """The sample's reward as a float (tensor and numpy scalars accepted)."""
    reward = sample["reward"]
    return float(reward.item() if hasattr(reward, "item") else reward)


def choose_samples(samples: Sequence[Mapping[str, Any]], num_to_print: int) -> list[Mapping[str, Any]]:
    """The ceil(n/2) highest-reward samples, then the floor(n/2) lowest (no sample twice), best first."""
    order = sorted(range(len(samples)), key=lambda i: reward_of(samples[i]), reverse=True)
    num_to_print = min(num_to_print, len(samples))
    num_best = (num_to_print + 1) // 2
    best = order[:num_best]
    worst = order[len(order) - (num_to_print - num_best) :] if num_to_print > num_best else []
    return [samples[i] for i in best + worst]


def render_sample(sample: Mapping[str, Any]) -> Text:
    """`[role] content` lines, each coloured by role, under a reward header (content is not markup)."""
    text = Text(f"reward {reward_of(sample):.4g}\n", style="bold")
    for message in sample.get("message_log", []):
        role = str(message.get("role", "?"))
        text.append(f"[{role}] ", style=f"bold {ROLE_STYLES.get(role, 'white')}")
        text.append(f"{message.get('content', '')}\n", style=ROLE_STYLES.get(role, "white"))
    return text


class SamplePrinter:
    """Saves every validation sample of a step and prints the chosen ones."""

    def __init__(self, directory: str | Path, num_to_print: int, console: Console | None = None):
        self.directory = Path(directory)
        self.num_to_print = num_to_print
        self.console = console or Console()

    def log(self, samples: Sequence[Mapping[str, Any]], step: int) -> Path:
        """Every sample needs a `reward` (the error names the first one without)."""
        for index, sample in enumerate(samples):
            if "reward" not in sample:
                raise ValueError(f"validation sample {index} has no 'reward' (keys: {sorted(sample)})")
        path = self.write(samples, step)
        if self.num_to_print > 0 and samples:
            self.console.print(self.panel(samples, step))
        return path

    def write(self, samples: Sequence[Mapping[str, Any]], step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step}.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(dict(sample), default=_json_default) + "\n" for sample in samples)
        return path

    def panel(self, samples: Sequence[Mapping[str, Any]], step: int) -> Panel:
        rewards = [reward_of(sample) for sample in samples]
        mean = sum(rewards) / len(rewards)
        summary = f"reward mean {mean:.4g}  min {min(rewards):.4g}  max {max(rewards):.4g}  n {len(rewards)}"
        header = Text(summary, style="bold")
        chosen = [render_sample(sample) for sample in choose_samples(samples, self.num_to_print)]
        return Panel(Group(header, *chosen), title=f"validation samples, step {step}")
