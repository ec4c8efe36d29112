"""`posttrain export CHECKPOINT OUT [--merge] [--base-model DIR]`: a Hugging Face model directory from a
posttrain checkpoint; from a LoRA checkpoint, a PEFT adapter directory, or with `--merge` a model with the
adapter merged in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.models.lora import is_lora_checkpoint
from posttrain.utils.native_checkpoint import auto_class
from posttrain.workers.policy.on_disk import checkpoint_to_hf


def main(args: Any) -> int:
    from transformers import AutoConfig

    path = Path(args.checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    policy_dir = path / "policy" if (path / "policy").is_dir() else path  # a run's step_N/, or its policy/
    lora = is_lora_checkpoint(policy_dir)
    if args.merge and not lora:
        raise FileNotFoundError(
            f"--merge: {policy_dir} is not a LoRA checkpoint (no lora/adapter_config.json); "
            "its weights are already full, export it without --merge"
        )
    merge = bool(args.merge) or not lora
    out_dir = checkpoint_to_hf(policy_dir, args.out_dir, merge=merge, base_model=args.base_model)
    if lora and not args.merge:
        print(
            f"exported the LoRA adapter of {args.checkpoint_dir} -> {out_dir} (load it with "
            "peft.PeftModel.from_pretrained(base_model, dir); --merge writes a merged model)"
        )
        return 0
    name = auto_class(AutoConfig.from_pretrained(out_dir)).__name__
    print(f"exported {args.checkpoint_dir} -> {out_dir} (load it with {name}.from_pretrained)")
    return 0
