"""reasoning-gym's procedural tasks as data: `data.dataset: reasoning_gym:<task>` (any of its tasks, or
`composite` with its weighted `datasets` list), `data.options` passed to `reasoning_gym.create_dataset`.
reasoning-gym builds item i from seed + i, so validation is drawn from the seeds after the training ones
and any question training also asks is dropped from it. Each row keeps its reasoning-gym entry (as JSON)
for the task's own scorer (`environments/reasoning_gym.py`)."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "reasoning_gym:"
ENTRY_COLUMN = "reasoning_gym_entry"


def is_reasoning_gym(source: str) -> bool:
    return source.startswith(PREFIX)


def check_task(source: str) -> str | None:
    """Why `source` cannot be loaded (the package missing, an unknown task), or None."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return "needs the reasoning-gym package: pip install 'posttrain[envs]'"
    task = source[len(PREFIX) :]
    if task not in DATASETS:
        return f"reasoning-gym has no task {task!r} (it has {len(DATASETS)}, e.g. chain_sum, leg_counting)"
    return None


def reasoning_gym_rows(
    source: str, options: dict[str, Any], num_train: int, num_val: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) of a reasoning-gym task: prompt, answer and the entry."""
    from reasoning_gym import create_dataset

    task = source[len(PREFIX) :]
    train = list(create_dataset(task, size=num_train, seed=seed, **options))
    asked, val, start = {entry["question"] for entry in train}, [], seed + num_train
    while len(val) < num_val and start < seed + num_train + 20 * num_val:  # a small task runs out: fewer
        fresh = create_dataset(task, size=num_val, seed=start, **options)
        val += [entry for entry in fresh if entry["question"] not in asked][: num_val - len(val)]
        start += num_val
    if len(val) < num_val:
        log.warning(
            "%s: %d validation questions of data.num_val=%d are not asked in training (the task has few "
            "questions at these data.options: lower data.num_train or widen the options)",
            source,
            len(val),
            num_val,
        )

    def row(entry: dict) -> dict:
        entry_json = json.dumps(entry, default=list)
        return {"prompt": entry["question"], "answer": str(entry["answer"]), ENTRY_COLUMN: entry_json}

    return [row(e) for e in train], [row(e) for e in val]
