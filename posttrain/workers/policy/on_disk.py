"""A model on disk as a Hugging Face directory: a posttrain checkpoint step (DCP, LoRA or Megatron, either
backend) or a GGUF file. `posttrain export` and `posttrain eval` both read models through here."""

from __future__ import annotations

from pathlib import Path

from posttrain.models.gguf import gguf_model_dir
from posttrain.models.lora import export_lora_checkpoint, is_lora_checkpoint
from posttrain.utils.native_checkpoint import MODEL_DIR, export_checkpoint_to_hf
from posttrain.workers.policy.megatron import MEGATRON_DIR


def find_policy_checkpoint(path: str | Path) -> Path | None:
    """The policy checkpoint inside a posttrain run's `step_N/` (its `policy/`), or `path` itself when it is
    one (DCP `model/`, a LoRA adapter or Megatron shards); None for anything else (a Hugging Face
    directory, a hub name, a GGUF file)."""
    path = Path(path)
    for candidate in (path / "policy", path):
        if (
            (candidate / MODEL_DIR / ".metadata").is_file()
            or is_lora_checkpoint(candidate)
            or (candidate / MEGATRON_DIR).is_dir()
        ):
            return candidate
    return None


def checkpoint_to_hf(
    policy_dir: Path, out_dir: str | Path, merge: bool = True, base_model: str | None = None
) -> Path:
    """A Hugging Face directory from a policy checkpoint; a LoRA one gives the base model (`base_model`, else
    the one it names) with the adapter merged in, or with `merge` False the PEFT adapter directory."""
    if is_lora_checkpoint(policy_dir):
        return export_lora_checkpoint(policy_dir, out_dir, merge=merge, base_model_dir=base_model)
    if (policy_dir / MEGATRON_DIR).is_dir():
        from posttrain.workers.policy.megatron_export import export_megatron_checkpoint

        return export_megatron_checkpoint(policy_dir, out_dir)
    return export_checkpoint_to_hf(policy_dir, out_dir, base_model_dir=base_model)


def hf_model_dir(model_name: str, scratch_dir: Path, key: str) -> Path | str:
    """What to load for `model_name`: a checkpoint step exported (merged) into `scratch_dir/model`, a `.gguf`
    file's cached plain directory, anything else (a Hugging Face directory or hub name) as given."""
    checkpoint = find_policy_checkpoint(model_name)
    if checkpoint is None:
        return gguf_model_dir(model_name, key=key)
    print(f"exporting checkpoint {checkpoint} to a Hugging Face directory first")
    return checkpoint_to_hf(checkpoint, scratch_dir / "model")
