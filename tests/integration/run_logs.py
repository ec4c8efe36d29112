"""Running a config to its end and reading its run directory's `metrics.jsonl` back in tests; the
`key=value` overrides that the tests give a config."""

import json
from pathlib import Path


def as_overrides(*values: dict) -> list[str]:
    """Command-line overrides `key=value` from the dicts `values`, a later dict's keys winning."""
    merged: dict = {}
    for more in values:
        merged.update(more)
    return [f"{key}={value}" for key, value in merged.items()]


def metrics_by_step(log_dir) -> dict[int, dict]:
    """Every metric logged at each step (one dict per step, the step's JSON lines merged)."""
    steps: dict[int, dict] = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def finished_run(cfg, setup, train):
    """`setup(cfg)`, then `train(run)` to the end with the run shut down whatever happens; the run (its
    logger's backends stay readable)."""
    run = setup(cfg)
    try:
        train(run)
    finally:
        run.shutdown()
    return run


def run_to_end(cfg, setup, train) -> dict[int, dict]:
    """`finished_run(cfg, setup, train)`; the metrics its run directory (`cfg.logger.log_dir`) holds, by
    step."""
    finished_run(cfg, setup, train)
    return metrics_by_step(cfg.logger.log_dir)
