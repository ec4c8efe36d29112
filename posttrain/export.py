"""`posttrain export CHECKPOINT OUT [--merge]`: a Hugging Face model directory from a posttrain checkpoint;
from a LoRA checkpoint, a PEFT adapter directory, or with `--merge` a model with the adapter merged in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.models.lora import export_lora_checkpoint, is_lora_checkpoint
from posttrain.utils.native_checkpoint import export_checkpoint_to_hf, is_sequence_classifier


def main(args: Any) -> int:
    from transformers import AutoConfig

    path = Path(args.checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    policy_dir = path / "policy" if (path / "policy").is_dir() else path  # a run's step_N/, or its policy/
    merge = bool(args.merge)
    lora = is_lora_checkpoint(policy_dir)
    if merge and not lora:
        raise FileNotFoundError(
            f"--merge: {policy_dir} is not a LoRA checkpoint (no lora/adapter_config.json); "
            "its weights are already full, export it without --merge"
        )
    if lora:  # either backend
        out_dir = export_lora_checkpoint(policy_dir, args.out_dir, merge=merge)
        if not merge:
            print(
                f"exported the LoRA adapter of {args.checkpoint_dir} -> {out_dir} (load it with "
                "peft.PeftModel.from_pretrained(base_model, dir); --merge writes a merged model)"
            )
            return 0
    elif (policy_dir / "megatron").is_dir():  # saved by policy.backend=megatron
        from posttrain.workers.policy.megatron_export import export_megatron_checkpoint

        out_dir = export_megatron_checkpoint(policy_dir, args.out_dir)
    else:
        out_dir = export_checkpoint_to_hf(policy_dir, args.out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    auto_class = (
        "AutoModelForSequenceClassification" if is_sequence_classifier(config) else "AutoModelForCausalLM"
    )
    if getattr(config, "vision_config", None) is not None:
        auto_class = "AutoModelForImageTextToText"
    print(f"exported {args.checkpoint_dir} -> {out_dir} (load it with {auto_class}.from_pretrained)")
    return 0
