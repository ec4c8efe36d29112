"""`posttrain export CHECKPOINT OUT`: a Hugging Face model directory from a posttrain checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.utils.native_checkpoint import export_checkpoint_to_hf, is_sequence_classifier


def policy_checkpoint_dir(checkpoint_dir: str | Path) -> Path:
    """Accept a run's `step_N/` (holding `policy/`) or the `policy/` directory itself."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    return path / "policy" if (path / "policy").is_dir() else path


def main(args: Any) -> int:
    from transformers import AutoConfig

    out_dir = export_checkpoint_to_hf(policy_checkpoint_dir(args.checkpoint_dir), args.out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    auto_class = "AutoModelForSequenceClassification" if is_sequence_classifier(config) else "AutoModelForCausalLM"
    if getattr(config, "vision_config", None) is not None:
        auto_class = "AutoModelForImageTextToText"
    print(f"exported {args.checkpoint_dir} -> {out_dir} (load it with {auto_class}.from_pretrained)")
    return 0
