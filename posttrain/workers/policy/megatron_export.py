"""`posttrain export` of a Megatron checkpoint (`policy/megatron/`): in this one process, build the
checkpoint's model at TP 1 / PP 1, load its weights through dist_checkpointing (which reshards whatever
tp/pp it was saved at) and write a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.utils import native_checkpoint
from posttrain.workers.policy import megatron_convert
from posttrain.workers.policy.base import ensure_process_group
from posttrain.workers.policy.megatron import MEGATRON_DIR, import_megatron, megatron_context


def export_megatron_checkpoint(policy_dir: str | Path, out_dir: str | Path) -> Path:
    """A Hugging Face directory (weights, config, tokenizer) from a Megatron checkpoint; on a machine
    without a GPU through the CPU shim (which patches torch.cuda for the rest of this process)."""
    from megatron.core import dist_checkpointing, parallel_state
    from transformers import AutoConfig, AutoTokenizer

    import_megatron()
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    hf_config = AutoConfig.from_pretrained(policy_dir / "hf_config")
    layout = megatron_convert.gpt_layout(hf_config, 1)
    ensure_process_group()
    with megatron_context(torch.cuda.is_available()):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        parallel = {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": False,
        }
        config = megatron_convert.transformer_config(hf_config, parallel, bf16=False)
        model = megatron_convert.build_gpt_model(hf_config, config, pre_process=True, post_process=True)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(policy_dir / MEGATRON_DIR))
        model.load_state_dict(state["model"])
    weights = megatron_convert.megatron_to_hf(
        {name: p.detach().float() for name, p in model.named_parameters()}, 0, layout
    )
    tokenizer = AutoTokenizer.from_pretrained(policy_dir / "tokenizer")
    model = native_checkpoint.model_with_weights(weights, hf_config)
    native_checkpoint.write_hf_dir(model, tokenizer, out_dir)
    return out_dir
