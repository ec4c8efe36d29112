"""Training and generation throughput of posttrain's backends, with model FLOPs utilisation (MFU).

For each model size: `Policy.train` tokens/s (one training worker, NLL on random token rows, one optimizer
step per global batch) and `generate` tokens/s (the HF backend; vLLM too where it is importable), each
set against the matrix-multiply FLOP/s measured in a Ray worker with the same threads (the trainer: the
machine's CPUs; the generation worker: half of them) or GPU share, same dtype. Prints a table and writes
JSON. A benchmark, not a test: numbers vary by machine.

FLOPs per token (Kaplan et al. 2020, PaLM appendix B): forward = 2 x (matmul parameters, output
projection included) + 2 x layers x context x hidden for causal attention (QK^T and AV over on average
half the context); training = 3 x forward. Generation counts the forward of each new token over its
average context.

Run: make bench   or   .venv/bin/python benchmarks/train_generate.py [--device cuda] [--sizes s,m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config import validate_config
from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.distributed.virtual_cluster import start_local_ray
from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer
from posttrain.workers.generation import GenerationConfig, make_generation
from posttrain.workers.policy import Policy, PolicyConfig

# Head size 64 everywhere: vLLM's CPU attention kernels need it (16 is not supported).
SIZES = {
    "xs": dict(hidden_size=128, num_layers=4, num_attention_heads=2, intermediate_size=512),
    "s": dict(hidden_size=256, num_layers=4, num_attention_heads=4, intermediate_size=1024),
    "m": dict(hidden_size=512, num_layers=8, num_attention_heads=8, intermediate_size=2048),
    "l": dict(hidden_size=1024, num_layers=16, num_attention_heads=16, intermediate_size=4096),
    "xl": dict(hidden_size=2048, num_layers=16, num_attention_heads=32, intermediate_size=8192),
}
DEFAULT_SIZES = {"cpu": "xs,s,m", "cuda": "m,l,xl"}


@dataclass
class Workload:
    """Batch shapes of one device kind."""

    train_rows: int  # sequences per optimizer step
    train_micro_batch: int
    seq_len: int  # tokens per training sequence
    gen_prompts: int
    prompt_len: int
    new_tokens: int


WORKLOADS = {
    "cpu": Workload(
        train_rows=16, train_micro_batch=8, seq_len=128, gen_prompts=32, prompt_len=16, new_tokens=64
    ),
    "cuda": Workload(
        train_rows=64, train_micro_batch=16, seq_len=512, gen_prompts=128, prompt_len=32, new_tokens=128
    ),
}


@dataclass
class Result:
    size: str
    params_m: float
    task: str  # train or generate:<backend>
    tokens_per_s: float
    tflops: float  # achieved model FLOP/s, in TFLOP/s
    mfu: float  # achieved / measured matmul FLOP/s
    seconds: list[float]


# ------------------------------------------------------------------------------------------- FLOPs
def matmul_params(cfg: ModelFromConfig, vocab_size: int) -> int:
    """Weights that take part in a matrix product per token: projections, MLP, output layer."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_dim = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    attention = 2 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * kv_dim
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attention + mlp) + vocab_size * cfg.hidden_size


def forward_flops_per_token(cfg: ModelFromConfig, vocab_size: int, mean_context: float) -> float:
    return 2.0 * matmul_params(cfg, vocab_size) + 2.0 * cfg.num_layers * mean_context * cfg.hidden_size


@ray.remote
def measure_matmul_flops(device: str, dtype_name: str, n: int, threads: int, repeats: int = 10) -> dict:
    """Best-of-repeats FLOP/s of an n x n x n matrix product in this worker (`threads` on a CPU, or its
    GPU)."""
    if device == "cpu":
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times[2:])
    return {
        "flops": 2.0 * n**3 / best,
        "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
    }


# ------------------------------------------------------------------------------------------- stages
def random_rows(num_rows: int, seq_len: int, vocab_size: int, seed: int) -> BatchedDataDict:
    """Full-length random token rows (ids past the special tokens), trained on every token but the first."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, vocab_size, (num_rows, seq_len), generator=generator)
    token_mask = torch.ones(num_rows, seq_len, dtype=torch.long)
    token_mask[:, 0] = 0
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.full((num_rows,), seq_len),
        token_mask=token_mask,
        sample_mask=torch.ones(num_rows),
    )


def cluster_config(device: str) -> ClusterConfig:
    """One bundle: the whole machine's CPUs, and its GPU on CUDA (the worker group takes half of each)."""
    return ClusterConfig(
        workers_per_node=1,
        num_cpus_per_worker=float(os.cpu_count() or 2),
        num_gpus_per_worker=1.0 if device == "cuda" else 0.0,
    )


def bench_train(model_dir: Path, device: str, work: Workload, steps: int) -> list[float]:
    """Seconds of each timed optimizer step (after one warm-up step)."""
    cluster = RayVirtualCluster(cluster_config(device))
    cfg = validate_config(
        PolicyConfig,
        dict(
            model_name=str(model_dir),
            precision="bfloat16" if device == "cuda" else "float32",
            train_global_batch_size=work.train_rows,
            train_micro_batch_size=work.train_micro_batch,
            logprob_batch_size=work.train_micro_batch,
            optimizer={"name": "AdamW", "kwargs": {"lr": 1e-4}},
        ),
    )
    policy = Policy(cluster, cfg)
    vocab_size = len(load_tokenizer(model_dir))
    seconds = []
    try:
        for step in range(steps + 1):
            data = random_rows(work.train_rows, work.seq_len, vocab_size, seed=step)
            start = time.perf_counter()
            policy.train(data, NLLLoss())
            if step > 0:
                seconds.append(time.perf_counter() - start)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return seconds


def generation_threads() -> int:
    """Threads of the generation worker: as many as its bundle's CPUs (half of the machine's here)."""
    return max(1, (os.cpu_count() or 2) // 2)


def bench_generate(model_dir: Path, device: str, backend: str, work: Workload, calls: int) -> list[float]:
    """Seconds of each timed generate call (after one warm-up call); every sample runs to new_tokens."""
    cfg = GenerationConfig(
        backend=backend,
        max_new_tokens=work.new_tokens,
        stop_token_ids=[],
        colocated=False,
        num_cpus_per_worker=float(generation_threads()),
        precision="bfloat16" if device == "cuda" else "float32",
        vllm_gpu_memory_utilization=0.3,
    )
    generation = make_generation(None, cfg, str(model_dir))
    vocab_size = len(load_tokenizer(model_dir))
    prompts = random_rows(work.gen_prompts, work.prompt_len, vocab_size, seed=0)
    seconds = []
    try:
        for call in range(calls + 1):
            start = time.perf_counter()
            out = generation.generate(prompts, seed=call)
            if call > 0:
                seconds.append(time.perf_counter() - start)
            generated = int(out["generation_lengths"].sum())
            if generated != work.gen_prompts * work.new_tokens:
                raise RuntimeError(
                    f"{backend}: generated {generated} tokens, expected every sample to run to the limit"
                )
    finally:
        generation.shutdown()
    return seconds


# ------------------------------------------------------------------------------------------- report
def result(
    size: str, params: int, task: str, tokens: int, seconds: list[float], flops_per_token: float, peak: float
) -> Result:
    tokens_per_s = tokens / statistics.median(seconds)
    achieved = tokens_per_s * flops_per_token
    return Result(size, params / 1e6, task, tokens_per_s, achieved / 1e12, achieved / peak, seconds)


def print_table(results: list[Result], peaks: dict[str, dict]) -> None:
    for name, peak in peaks.items():
        print(
            f"measured matmul peak ({name}): {peak['flops'] / 1e12:.3f} TFLOP/s, {peak['threads']} threads, "
            f"{peak['device_name']}"
        )
    print(f"{'size':<5}{'params':>9}  {'task':<15}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for r in results:
        print(
            f"{r.size:<5}{r.params_m:>8.1f}M  "
            f"{r.task:<15}{r.tokens_per_s:>12,.0f}{r.tflops:>10.3f}{r.mfu:>8.1%}"
        )


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def run(args: argparse.Namespace) -> dict:
    device = args.device
    work = WORKLOADS[device]
    dtype = "bfloat16" if device == "cuda" else "float32"
    start_local_ray(max(4, os.cpu_count() or 2), log_to_driver=False)
    # The peak of each worker's own threads: the trainer computes with the whole bundle (the machine's CPUs),
    # the generation worker with its half (on a GPU both measure the device).
    half = {"num_cpus": (os.cpu_count() or 2) / 2, "num_gpus": 0.5 if device == "cuda" else 0}
    n = 4096 if device == "cuda" else 1024
    train_peak, generate_peak = (
        ray.get(measure_matmul_flops.options(**half).remote(device, dtype, n, threads))
        for threads in (os.cpu_count() or 2, generation_threads())
    )
    peaks = {f"{dtype}, trainer": train_peak, f"{dtype}, generation worker": generate_peak}
    backends = [b for b in args.backends.split(",") if b != "vllm" or vllm_available()]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="posttrain_bench_") as tmp:
        for size in args.sizes.split(","):
            model_cfg = ModelFromConfig(
                architecture="qwen2", seed=0, max_position_embeddings=1024, **SIZES[size]
            )
            model_dir = build_model_dir(model_cfg, Path(tmp) / size)
            vocab_size = len(load_tokenizer(model_dir))
            params = param_count(model_dir)
            seconds = bench_train(model_dir, device, work, args.steps)
            per_token = 3 * forward_flops_per_token(model_cfg, vocab_size, work.seq_len / 2)
            results.append(
                result(
                    size,
                    params,
                    "train",
                    work.train_rows * work.seq_len,
                    seconds,
                    per_token,
                    train_peak["flops"],
                )
            )
            for backend in backends:
                seconds = bench_generate(model_dir, device, backend, work, args.calls)
                context = work.prompt_len + work.new_tokens / 2
                per_token = forward_flops_per_token(model_cfg, vocab_size, context / 2)
                results.append(
                    result(
                        size,
                        params,
                        f"generate:{backend}",
                        work.gen_prompts * work.new_tokens,
                        seconds,
                        per_token,
                        generate_peak["flops"],
                    )
                )
            print_table(results[-1 - len(backends) :], {})
    ray.shutdown()
    print_table(results, peaks)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "peaks": peaks,
        "workload": asdict(work),
        "results": [asdict(r) for r in results],
        "skipped_backends": sorted(set(args.backends.split(",")) - set(backends)),
    }


def param_count(model_dir: Path) -> int:
    from posttrain.models.build import load_model

    return sum(p.numel() for p in load_model(model_dir).parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--sizes", default=None, help=f"comma list of {sorted(SIZES)} (default: per device)")
    parser.add_argument(
        "--backends", default="hf,vllm", help="generation backends (vllm: only where importable)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per size")
    parser.add_argument("--calls", type=int, default=2, help="timed generate calls per size and backend")
    parser.add_argument(
        "--out", default="benchmarks/results/train_generate_{device}.json", help="JSON output"
    )
    args = parser.parse_args()
    args.sizes = args.sizes or DEFAULT_SIZES[args.device]
    report = run(args)
    out = Path(args.out.format(device=args.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
