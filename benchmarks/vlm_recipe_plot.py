"""The vision-language recipe (docs/models.md) as one curve: greedy validation accuracy on red_squares
through SFT (`posttrain eval` of the initial model and of each SFT checkpoint) and then GRPO (its own
validations).

    python benchmarks/vlm_recipe_plot.py RESULTS_DIR OUT_PNG

RESULTS_DIR holds the recipe's runs (vlm_sft_tiny/, vlm_grpo_tiny/) and eval summaries eval_sft_step_N/
(N = 0 for the initial model). Prints the numbers it plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from posttrain.utils.plot import metric_series, read_metrics


def main(results: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft = sorted(
        (int(p.name.rsplit("_", 1)[1]), json.loads((p / "summary.json").read_text())["accuracy"])
        for p in results.glob("eval_sft_step_*")
    )
    sft_steps = max(step for step, _ in sft)
    grpo_steps, grpo_acc = metric_series(
        read_metrics(results / "vlm_grpo_tiny" / "metrics.jsonl"), "val/accuracy"
    )
    print("SFT   (step, greedy val accuracy):", sft)
    print("GRPO  (step, greedy val accuracy):", list(zip(grpo_steps, grpo_acc)))
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([s for s, _ in sft], [a for _, a in sft], marker="o", label="SFT (posttrain eval)")
    ax.plot([sft_steps + s for s in grpo_steps], grpo_acc, marker="o", label="GRPO (validation)")
    ax.set_xlabel("optimizer step (SFT, then GRPO)")
    ax.set_ylabel("greedy val accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("tiny Qwen2-VL (0.39M) on red_squares")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
