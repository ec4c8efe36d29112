"""Context parallelism on CPU: peak memory per rank and step time of one training step on one long
sequence at CP 1, 2 and 4, and the longest sequence each fits in a fixed memory budget per rank.

Each CP size runs in its own group of processes (torch.multiprocessing, gloo; the real
`DTensorPolicyWorker`, without Ray): one SFT step (NLLLoss, AdamW) on one row of random tokens. Peak memory
of a step: the process's resident-set high-water mark during the step (reset before it through
/proc/self/clear_refs, after returning freed memory to the system with malloc_trim) minus its resident set
before it, the largest over the ranks. Step time: the slowest rank's wall time of the second step at each
length (the first warms up). The budget search doubles the length from 4,096 tokens while the step fits.

On a 2-core machine CP 4 runs 4 processes on 2 cores (one thread each; CP 1 gets 2 threads, CP 2 one
each), and the machine may be shared: the step times are noisy and say little about speed-up; the memory
is the figure this benchmark is for.

Run: .venv/bin/python benchmarks/context_parallel.py [--out benchmarks/reference/context_parallel_cpu.json]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.algorithms.loss import NLLLoss
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.dtensor import DTensorPolicyWorker

MODEL = dict(
    architecture="llama",
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=131072,
)
CP_SIZES = (1, 2, 4)
SEQ_LEN = 16384
BUDGET_BYTES = 256 << 20  # 256 MiB of step memory per rank
SEARCH_LENGTHS = (4096, 8192, 16384, 32768)


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Free what can be freed, reset the high-water mark; the resident bytes now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return resident_bytes("VmRSS")


def one_row(seq_len: int) -> BatchedDataDict:
    input_ids = torch.randint(4, 100, (1, seq_len), generator=torch.Generator().manual_seed(0))
    token_mask = torch.ones(1, seq_len, dtype=torch.long)
    token_mask[:, 0] = 0
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([seq_len]), token_mask=token_mask)


def measured_step(worker: DTensorPolicyWorker, seq_len: int) -> tuple[int, float]:
    """(peak bytes over the step's start, seconds) of one training step, the largest over the ranks."""
    data = one_row(seq_len)
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    worker.train(data, NLLLoss())
    result = torch.tensor([float(resident_bytes("VmHWM") - before), time.perf_counter() - start])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return int(result[0]), float(result[1])


def run_rank(rank: int, cp: int, model_dir: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp))
    torch.set_num_threads(max(1, 2 // cp))
    cfg = PolicyConfig(
        model_name=model_dir,
        context_parallel_size=cp,
        train_global_batch_size=1,
        train_micro_batch_size=1,
        max_grad_norm=1.0,
    )
    worker = DTensorPolicyWorker(cfg)
    measured_step(worker, 2048)  # warm-up: optimizer state, first-call allocations
    measured_step(worker, SEQ_LEN)
    peak, seconds = measured_step(worker, SEQ_LEN)
    row = {"cp": cp, "seq_len": SEQ_LEN, "peak_step_bytes_per_rank": peak, "step_s": round(seconds, 3)}
    fits = []
    for seq_len in SEARCH_LENGTHS:
        peak_at, seconds_at = measured_step(worker, seq_len)
        fits.append({"seq_len": seq_len, "peak_step_bytes_per_rank": peak_at, "step_s": round(seconds_at, 3)})
        if peak_at > BUDGET_BYTES:
            break
    row["longest_within_budget"] = max(
        (f["seq_len"] for f in fits if f["peak_step_bytes_per_rank"] <= BUDGET_BYTES), default=0
    )
    row["search"] = fits
    if rank == 0:
        Path(out).write_text(json.dumps(row))
    worker.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/reference/context_parallel_cpu.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model_dir(ModelFromConfig(**MODEL), Path(tmp) / "model"))
        for cp in CP_SIZES:
            out = str(Path(tmp) / f"cp{cp}.json")
            mp.spawn(run_rank, args=(cp, model_dir, free_port(), out), nprocs=cp)
            rows.append(json.loads(Path(out).read_text()))
            print(
                f"cp {cp}: {SEQ_LEN} tokens, peak {rows[-1]['peak_step_bytes_per_rank'] / 2**20:.0f} MiB per "
                f"rank, step {rows[-1]['step_s']:.2f} s; longest within {BUDGET_BYTES / 2**20:.0f} MiB: "
                f"{rows[-1]['longest_within_budget']}"
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {
            "device": "cpu",
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "note": "shared with other work while measured; CP 4 = 4 processes on these cores",
        },
        "model": MODEL,
        "budget_bytes_per_rank": BUDGET_BYTES,
        "attention": "all-gather of keys and values over the CP ranks (not a ring)",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
