"""Memory per rank and step time of a tiny Qwen3-MoE on the DTensor backend at expert parallelism 1 and 2.

Each setting is a real policy of `--workers` Ray workers (FSDP2 over gloo on a CPU; EP 2 splits every MoE
layer's experts over rank pairs, tokens travel by all-to-all): it takes `--steps` AdamW steps on the same
random rows, after one warm-up step. Reported per rank: parameter and optimizer-state bytes
(`Policy.memory_footprint()`), the workers' peak resident memory (VmHWM of their processes), and the
median step time. On a shared CPU the times are noisy; the bytes are exact.

Run: .venv/bin/python benchmarks/moe_parallel.py [--workers 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from posttrain.algorithms.loss import NLLLoss
from posttrain.config import validate_config
from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.distributed.virtual_cluster import start_local_ray
from posttrain.models.tokenizer import build_byte_tokenizer
from posttrain.workers.policy import Policy, PolicyConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_report beside this script
from step_report import actor_peak_rss  # noqa: E402

MOE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
NUM_ROWS, SEQ_LEN = 16, 64


def build_moe_dir(path: Path) -> Path:
    tokenizer = build_byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(vocab_size=len(tokenizer), **MOE))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(model_dir: Path, workers: int, ep: int, steps: int) -> dict:
    cfg = validate_config(
        PolicyConfig,
        dict(
            model_name=str(model_dir),
            train_global_batch_size=NUM_ROWS,
            train_micro_batch_size=4,
            expert_parallel_size=ep,
            optimizer={"name": "AdamW", "kwargs": {"lr": 1e-3}},
        ),
    )
    earlier_workers = set(
        actor_peak_rss("DTensorPolicyWorker")
    )  # a previous policy's workers may still be exiting
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, num_cpus_per_worker=0.5))
    policy = Policy(cluster, cfg)
    generator = torch.Generator().manual_seed(0)
    data = BatchedDataDict(
        input_ids=torch.randint(4, 250, (NUM_ROWS, SEQ_LEN), generator=generator),
        input_lengths=torch.full((NUM_ROWS,), SEQ_LEN),
        token_mask=torch.ones(NUM_ROWS, SEQ_LEN, dtype=torch.long),
        sample_mask=torch.ones(NUM_ROWS),
    )
    policy.train(data, NLLLoss())  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        policy.train(data, NLLLoss())
        times.append(time.perf_counter() - start)
    footprints = policy.memory_footprint()
    row = {
        "workers": workers,
        "expert_parallel_size": ep,
        "param_bytes_per_rank": [f["param_bytes"] for f in footprints],
        "optimizer_state_bytes_per_rank": [f["optimizer_state_bytes"] for f in footprints],
        "peak_rss_bytes_per_rank": sorted(
            b for pid, b in actor_peak_rss("DTensorPolicyWorker").items() if pid not in earlier_workers
        ),
        "step_time_s_median": statistics.median(times),
        "step_times_s": times,
    }
    policy.shutdown()
    cluster.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/reference/moe_parallel_cpu.json")
    args = parser.parse_args()
    start_local_ray(args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_moe_dir(Path(tmp) / "moe")
        total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        rows = [measure(model_dir, args.workers, ep, args.steps) for ep in (1, 2)]
    for row in rows:
        print(
            f"EP {row['expert_parallel_size']} on {row['workers']} workers: params/rank "
            f"{row['param_bytes_per_rank']} B, optimizer/rank {row['optimizer_state_bytes_per_rank']} B, "
            f"peak RSS {[b // 2**20 for b in row['peak_rss_bytes_per_rank']]} MiB, "
            f"step {row['step_time_s_median']:.3f} s"
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": "cpu (gloo)"},
        "model": {**MOE, "architecture": "qwen3_moe", "num_parameters": total},
        "batch": {"rows": NUM_ROWS, "seq_len": SEQ_LEN, "micro_batch": 4},
        "rows": rows,
        "notes": "CPU machine shared with other jobs while measured: step times are noisy. At EP 2 on 2 "
        "workers each rank holds half of the experts (not further sharded) and half of the dense "
        "parameters (FSDP), the same bytes as FSDP alone over 2 workers; EP replaces FSDP's all-gather "
        "of the expert weights by an all-to-all of the routed tokens. Peak RSS lists every "
        "ray::DTensorPolicyWorker process that appeared during the run, which on a shared machine can "
        "include another job's.",
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
