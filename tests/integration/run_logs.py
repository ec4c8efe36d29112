"""Running a config to its end and reading its run directory's `metrics.jsonl` back in tests."""

import json
from pathlib import Path


def metrics_by_step(log_dir) -> dict[int, dict]:
    """Every metric logged at each step (one dict per step, the step's JSON lines merged)."""
    steps: dict[int, dict] = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def run_to_end(cfg, setup, train) -> dict[int, dict]:
    """`setup(cfg)`, then `train(run)` to the end with the run shut down whatever happens; the metrics its
    run directory (`cfg.logger.log_dir`) holds, by step."""
    run = setup(cfg)
    try:
        train(run)
    finally:
        run.shutdown()
    return metrics_by_step(cfg.logger.log_dir)
