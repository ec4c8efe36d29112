"""Reading a run directory's `metrics.jsonl` back in tests."""

import json
from pathlib import Path


def metrics_by_step(log_dir) -> dict[int, dict]:
    """Every metric logged at each step (one dict per step, the step's JSON lines merged)."""
    steps: dict[int, dict] = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps
