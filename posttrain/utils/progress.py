"""Progress for long loops: a rich progress bar on a terminal, one line per step with rate and ETA
otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class StepProgress:
    """`with StepProgress("grpo", total=200, start=0) as p: p.advance(step, {"loss": 0.1})`."""

    def __init__(self, description: str, total: int, start: int = 0, console: Console | None = None):
        self.description, self.total, self.start = description, total, start
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal and sys.stderr.isatty()
        self._progress: Progress | None = None
        self._t0 = time.monotonic()

    def __enter__(self) -> StepProgress:
        self._t0 = time.monotonic()
        if self.interactive:
            columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
            columns += (TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self._progress = Progress(*columns, console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(
                self.description, total=self.total, completed=self.start, info=""
            )
        return self

    def advance(self, step: int, info: dict[str, float] | None = None) -> None:
        """Record that `step` (1-based, absolute) finished; `info` values are shown next to it."""
        text = "  ".join(f"{k} {v:.4g}" for k, v in (info or {}).items())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=text)
            return
        done = step - self.start
        elapsed = time.monotonic() - self._t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        self.console.print(
            f"{self.description} step {step}/{self.total}  {text}  {rate:.2f} steps/s  ETA "
            f"{format_duration(eta)}",
            highlight=False,
        )

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
