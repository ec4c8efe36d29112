"""vLLM refit benchmark: the time and the disk bytes of one refit of the vLLM generation backend, with the
weights handed to the engine in memory (`generation.vllm_refit: memory`, the default) and written as a
safetensors file for it to reload (`disk`), and the decode speed of the engine in each set-up (in the
actor's process for `memory`, in a process of its own for `disk`).

Each refit sends every weight of the model, changed by a small seeded perturbation, to one generation
actor: through Ray's object store (`memory`, `disk`; as GRPO's refit does apart or across nodes) or, in
`shared` (`memory` fed as colocated GRPO on one machine's CPUs feeds it), copied into a shared-memory file
the actor maps. The time is the driver's wall time of that copy (shared) and of `update_weights`.
Decode: 8 prompts of 16 random tokens, every sample running to 64 new tokens.
The modes alternate (`--runs`), so a change of machine load hits both.

Run (in the vLLM environment, `make install-vllm`; needs `make real-model` for the default model):
    .venv-vllm/bin/python benchmarks/vllm_refit.py [--model-dir DIR] [--runs 2] [--refits 3]
Writes benchmarks/results/vllm_refit.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from posttrain.distributed import BatchedDataDict
from posttrain.distributed.shared_weights import SharedWeightsWriter
from posttrain.distributed.virtual_cluster import start_local_ray
from posttrain.models.build import load_model
from posttrain.workers.generation import GenerationConfig, VllmGeneration

NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 16, 64


def random_prompts(vocab_size: int) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, vocab_size, (NUM_PROMPTS, PROMPT_LEN), generator=generator)
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.full((NUM_PROMPTS,), PROMPT_LEN))


def perturbed(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 1e-4 * torch.randn(t.shape, generator=generator) for name, t in state_dict.items()}


def shared_refit(generation: VllmGeneration, writer: SharedWeightsWriter, weights: dict) -> float:
    """Seconds of one refit through shared memory: the copy into the file, then the engine's reload."""
    start = time.perf_counter()
    for name, tensor in weights.items():
        writer.views[name].copy_(tensor)
    generation.update_weights(writer.handle)
    return time.perf_counter() - start


def measure(mode: str, model_dir: str, state_dict: dict, prompts: BatchedDataDict, refits: int) -> dict:
    """Refit seconds (each refit) and decode tokens/s (after a warm-up call) of one engine in `mode`."""
    import ray

    cfg = GenerationConfig(
        backend="vllm",
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=[],
        colocated=False,
        num_cpus_per_worker=float(os.cpu_count() or 2),
        vllm_gpu_memory_utilization=0.2,
        vllm_refit="memory" if mode == "shared" else mode,
    )
    generation = VllmGeneration(None, cfg, model_dir)
    layout = {name: (tuple(t.shape), t.dtype) for name, t in state_dict.items()}
    node_id = ray.get_runtime_context().get_node_id()
    writer = SharedWeightsWriter(layout, node_id) if mode == "shared" else None
    try:
        generation.generate(prompts, seed=0)
        start = time.perf_counter()
        out = generation.generate(prompts, seed=1)
        decode_s = time.perf_counter() - start
        assert int(out["generation_lengths"].sum()) == NUM_PROMPTS * NEW_TOKENS
        refit_s = [
            shared_refit(generation, writer, perturbed(state_dict, seed))
            if writer
            else generation.update_weights(perturbed(state_dict, seed))
            for seed in range(refits)
        ]
    finally:
        generation.shutdown()
        if writer:
            writer.close()
    return {"refit_s": refit_s, "decode_tokens_per_s": NUM_PROMPTS * NEW_TOKENS / decode_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--refits", type=int, default=3, help="timed refits per run")
    parser.add_argument("--out", default="benchmarks/results/vllm_refit.json")
    args = parser.parse_args()
    model = load_model(args.model_dir)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    vocab_size = model.config.vocab_size
    del model
    weight_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    start_local_ray(os.cpu_count() or 2, log_to_driver=False)
    prompts = random_prompts(vocab_size)
    runs: dict[str, list[dict]] = {"disk": [], "memory": [], "shared": []}
    for run in range(args.runs):
        for mode in runs:
            runs[mode].append(measure(mode, args.model_dir, state_dict, prompts, args.refits))
            print(f"run {run} {mode}: {runs[mode][-1]}", flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
        "model": args.model_dir,
        "weight_bytes": weight_bytes,
        "refits_per_run": args.refits,
        "runs": args.runs,
        "decode": f"{NUM_PROMPTS} prompts x {PROMPT_LEN} tokens, {NEW_TOKENS} new tokens each",
        "modes": {
            mode: {
                "refit_median_s": statistics.median(s for r in results for s in r["refit_s"]),
                "disk_bytes_per_refit": weight_bytes if mode == "disk" else 0,
                "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in results),
                "runs": results,
            }
            for mode, results in runs.items()
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for mode, row in report["modes"].items():
        print(
            f"{mode:>6}: refit {row['refit_median_s']:.3f} s, {row['disk_bytes_per_refit']:,} bytes to disk, "
            f"decode {row['decode_tokens_per_s']:.0f} tokens/s"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
