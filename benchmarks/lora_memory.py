"""Memory and refit size of LoRA against full fine-tuning: bytes of trainable parameters, of optimizer
state (AdamW) and of one refit (what the policy sends to the generation workers).

`measured` rows train a real policy (one FSDP2 worker in Ray, one AdamW step on random rows) and read
`Policy.memory_footprint()` and `Policy.last_weights_bytes()`: the model of configs/sft_tiny.yaml. `shapes`
rows count the same quantities from the parameter shapes of larger architectures built on the meta device
(no weights, no training): trainable parameters x 4 bytes (fp32), AdamW state = 2 x that + a 4-byte step
per tensor, refit = the trainable tensors in the generation dtype (fp32 here). Prints a table, writes JSON.

Run: .venv/bin/python benchmarks/lora_memory.py [--out benchmarks/reference/lora_memory.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config import validate_config
from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.distributed.virtual_cluster import start_local_ray
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.models.lora import LoraConfig, wrap_with_lora
from posttrain.workers.policy import Policy, PolicyConfig

TINY = dict(architecture="llama", hidden_size=128, num_layers=4, num_attention_heads=4, intermediate_size=512)
# Architectures counted from shapes (Hugging Face configs of the public models).
SHAPES = {
    "SmolLM2-135M": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
RANK, ALPHA = 8, 16.0


def measure_policy(model_dir: Path, lora: bool) -> dict[str, int]:
    """One AdamW step of a 1-worker policy on 8 random rows; its footprint and the bytes of a full refit."""
    cfg = validate_config(
        PolicyConfig,
        dict(
            model_name=str(model_dir),
            train_global_batch_size=8,
            train_micro_batch_size=8,
            seed=0,
            lora={"enabled": lora, "rank": RANK, "alpha": ALPHA},
        ),
    )
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=1, num_cpus_per_worker=1))
    policy = Policy(cluster, cfg)
    try:
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(4, 100, (8, 16), generator=generator)
        token_mask = torch.ones_like(input_ids)
        token_mask[:, 0] = 0
        policy.train(
            BatchedDataDict(
                input_ids=input_ids,
                input_lengths=torch.full((8,), 16),
                token_mask=token_mask,
                sample_mask=torch.ones(8),
            ),
            NLLLoss(),
        )
        footprint = policy.memory_footprint()[0]
        policy.get_weights(only_changed=False)
        return {
            "param_bytes": footprint["param_bytes"],
            "trainable_param_bytes": footprint["trainable_param_bytes"],
            "optimizer_state_bytes": footprint["optimizer_state_bytes"],
            "refit_bytes": policy.last_weights_bytes(),
        }
    finally:
        policy.shutdown()
        cluster.shutdown()


def count_from_shapes(hf_config: dict, lora: bool) -> dict[str, int]:
    """The same four numbers from parameter shapes on the meta device (fp32, AdamW)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora:
        model = wrap_with_lora(model, LoraConfig(enabled=True, rank=RANK, alpha=ALPHA))
    params = list(model.parameters())  # a tied embedding counts once
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(p.numel() * 4 for p in trainable)
    return {
        "param_bytes": sum(p.numel() * 4 for p in params),
        "trainable_param_bytes": trainable_bytes,
        "optimizer_state_bytes": 2 * trainable_bytes + 4 * len(trainable),
        "refit_bytes": trainable_bytes,
    }


def human(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/lora_memory.json", help="JSON output file")
    args = parser.parse_args()
    start_local_ray(2, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(ModelFromConfig(**TINY), Path(tmp) / "tiny")
        for lora in (False, True):
            rows.append(
                {
                    "model": "sft_tiny (1.1M)",
                    "how": "measured",
                    "mode": "lora" if lora else "full",
                    **measure_policy(model_dir, lora),
                }
            )
    for name, hf_config in SHAPES.items():
        for lora in (False, True):
            rows.append(
                {
                    "model": name,
                    "how": "shapes",
                    "mode": "lora" if lora else "full",
                    **count_from_shapes(hf_config, lora),
                }
            )
    print(f"LoRA rank {RANK}, alpha {ALPHA:g}, on q,k,v,o,gate,up,down; AdamW; fp32")
    print(
        f"{'model':<18}{'how':<10}{'mode':<6}{'trainable':>12}{'optimizer':>12}{'refit':>12}"
        f"{'refit / full':>14}"
    )
    full_refit = {}
    for row in rows:
        if row["mode"] == "full":
            full_refit[row["model"]] = row["refit_bytes"]
        row["refit_fraction_of_full"] = row["refit_bytes"] / full_refit[row["model"]]
        print(
            f"{row['model']:<18}{row['how']:<10}{row['mode']:<6}{human(row['trainable_param_bytes']):>12}"
            f"{human(row['optimizer_state_bytes']):>12}{human(row['refit_bytes']):>12}"
            f"{row['refit_fraction_of_full']:>14.4f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rank": RANK, "alpha": ALPHA, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
