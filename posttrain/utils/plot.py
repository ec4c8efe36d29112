"""Curves from a run's `metrics.jsonl` as a PNG (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl file, in order."""
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_series(records: list[dict], key: str, step_offset: int = 0) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; records without it are skipped."""
    pairs = [(r["step"] + step_offset, r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def plot_curves(
    series: dict[str, Any], out_png: str | Path, title: str = "", xlabels: dict[str, str] | None = None
) -> Path:
    """One panel per named series, drawn against steps unless `xlabels` names the panel's x axis: a series
    is (xs, values), or a dict of labelled (xs, values) lines drawn in one panel. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {name: lines if isinstance(lines, dict) else {"": lines} for name, lines in series.items()}
    names = [name for name, lines in panels.items() if any(xs for xs, _ in lines.values())]
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.6 * max(1, len(names))), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for label, (xs, values) in panels[name].items():
            ax.plot(xs, values, marker="o" if len(xs) < 40 else None, markersize=3, label=label or None)
        if len(panels[name]) > 1:
            ax.legend()
        ax.set_ylabel(name)
        ax.set_xlabel((xlabels or {}).get(name, "step"))
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
