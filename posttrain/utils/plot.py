"""Curves from a run's `metrics.jsonl` as a PNG (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl file, in order."""
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_series(records: list[dict], key: str, step_offset: int = 0) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; records without it are skipped."""
    pairs = [(r["step"] + step_offset, r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def plot_curves(
    series: dict[str, tuple[list[int], list[float]]], out_png: str | Path, title: str = ""
) -> Path:
    """One panel per named series (name -> (steps, values)); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, (steps, _) in series.items() if steps]
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.6 * max(1, len(names))), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps, values = series[name]
        ax.plot(steps, values, marker="o" if len(steps) < 40 else None, markersize=3)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
