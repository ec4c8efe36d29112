"""The HF backend's decode loops side by side: tokens/s of the eager loop (decode.decode_batch) and the static
one (static_decode.static_decode_batch) at equal work, measured alternately in one process, and a profile of
one decode step of each: CPU-side time vs device kernel time per step (torch.profiler) and, on CUDA, the
host syncs per step (torch.cuda.set_sync_debug_mode).

Run: .venv/bin/python benchmarks/decode_profile.py [--device cpu|cuda] [--size tiny|0.5b] [--out F]
(the sizes: grpo_step.py's workloads, 2x8 samples of <= 64 tokens and 8x8 of <= 128).
(`make gpu-check` runs it on the GPU and writes benchmarks/reference/decode_profile_<gpu>.json)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, imported by name
import grpo_step  # noqa: E402

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer  # noqa: E402
from posttrain.workers.generation import decode  # noqa: E402
from posttrain.workers.generation.config import GenerationConfig  # noqa: E402
from posttrain.workers.generation.static_decode import StaticDecoder, static_decode_batch  # noqa: E402


def workload_model(size: str) -> ModelFromConfig:
    """`grpo_step.py`'s model of that workload (tiny: 256 x 4 layers; 0.5b: 896 x 32 layers)."""
    return grpo_step.WORKLOADS[size].model


def make_batch(tokenizer, num_rows: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [B, T] of uneven lengths (prompt_len // 2 .. prompt_len)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (num_rows,), generator=generator)
    ids = torch.randint(3, min(len(tokenizer), 250), (num_rows, prompt_len), generator=generator)
    return decode.right_to_left_padded(ids, lengths, tokenizer.pad_token_id)


def run_loop(model, tokenizer, batch, cfg: GenerationConfig, loop: str, sync_every: int = 8) -> int:
    """One sampled decode of `batch` with the eager or static loop; returns the tokens generated."""
    left_ids, mask = batch
    uniforms = decode.per_sample_uniforms(0, list(range(left_ids.shape[0])), cfg.max_new_tokens)
    if loop == "static":
        state = static_decode_batch(model, tokenizer, left_ids, mask, cfg, False, uniforms, sync_every)
    else:
        state = decode.decode_batch(
            model, tokenizer, left_ids, mask, cfg, False, uniforms, [[]] * len(left_ids)
        )
    return sum(len(ids) for ids in state.generated_ids)


def tokens_per_s(model, tokenizer, batch, cfg: GenerationConfig, repeats: int) -> dict[str, float]:
    """Median tokens/s of each loop, the two alternating (one warm-up each) so that both see the same load."""
    seconds: dict[str, list[float]] = {"eager": [], "static": []}
    tokens = {}
    for repeat in range(repeats + 1):
        for loop in seconds:
            sync(model)
            start = time.perf_counter()
            tokens[loop] = run_loop(model, tokenizer, batch, cfg, loop)
            sync(model)
            if repeat:
                seconds[loop].append(time.perf_counter() - start)
    return {loop: tokens[loop] / sorted(s)[len(s) // 2] for loop, s in seconds.items()}


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


@torch.inference_mode()
def profile_steps(
    model, tokenizer, batch, cfg: GenerationConfig, loop: str, num_steps: int
) -> dict[str, float]:
    """Per decode step of `loop`: ms of CPU-side time (self time of all CPU ops and Python, as the profiler
    counts wall time on the host), ms of device kernel time, and host syncs (CUDA only, else None)."""
    from torch.profiler import ProfilerActivity, profile

    left_ids, mask = batch
    on_cuda = next(model.parameters()).is_cuda
    uniforms = decode.per_sample_uniforms(0, list(range(left_ids.shape[0])), cfg.max_new_tokens)
    if loop == "static":
        decoder = StaticDecoder(model, cfg, False, [])
        rows = decoder.start(left_ids, mask, uniforms)
        decoder.run_step(rows)  # warm-up (and on CUDA the capture)
        decoder.run_step(rows)

        def step() -> None:
            decoder.run_step(rows)
    else:
        device = next(model.parameters()).device
        cache, logits = decode.prefill(model, left_ids.to(device), mask.to(device))
        state = {
            "cache": decode.reserve(cache, cfg.max_new_tokens),
            "logits": logits,
            "mask": mask.to(device),
        }
        state["positions"] = state["mask"].sum(-1, keepdim=True)

        def step() -> None:  # decode_batch's step body, without its Python bookkeeping of samples
            tokens, logprobs = decode.choose_tokens(state["logits"], cfg, False, uniforms[:, 0].to(device))
            tokens.cpu(), logprobs.cpu()
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(len(tokens), 1)], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=state["mask"],
                position_ids=state["positions"],
                use_cache=True,
                **decode.cache_argument(model, state["cache"]),
            )
            state["logits"], state["positions"] = out.logits[:, -1, :], state["positions"] + 1

        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    syncs = None
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")
        start = time.perf_counter()
        if on_cuda:
            torch.cuda.set_sync_debug_mode("warn")  # each synchronizing call warns
        for _ in range(num_steps):
            step()
        if on_cuda:
            torch.cuda.set_sync_debug_mode(0)  # before the final wait, which is not a step's
            syncs = sum("synchroniz" in str(w.message) for w in caught) / num_steps
        sync(model)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) if on_cuda else 0.0
    cpu_us = sum(e.self_cpu_time_total for e in events)
    return {
        "wall_ms_per_step": 1e3 * wall / num_steps,
        "cpu_op_ms_per_step": cpu_us / 1e3 / num_steps,
        "kernel_ms_per_step": kernel_us / 1e3 / num_steps,
        "host_syncs_per_step": syncs,
    }


def measure(
    size: str,
    device: str,
    prompt_len: int,
    repeats: int,
    model: ModelFromConfig | None = None,
    shape: tuple[int, int] | None = None,
) -> dict:
    """Both loops on `grpo_step.py`'s workload `size` (its samples per step and max_new_tokens, no stop
    token: equal work): tokens/s and a 16-step profile each, as one JSON-ready dict. `model` replaces the
    workload's model (a toy one for a dry run), `shape` its (rows, new tokens)."""
    workload = grpo_step.WORKLOADS[size]
    num_rows, new_tokens = shape or (workload.num_prompts * workload.num_generations, workload.max_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="decode_profile_"))
    model_dir = build_model_dir(model or workload_model(size), work / size)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(str(model_dir), dtype=dtype).to(device).eval()
    tokenizer = load_tokenizer(str(model_dir))
    batch = make_batch(tokenizer, num_rows, prompt_len)
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=[])
    speeds = tokens_per_s(model, tokenizer, batch, cfg, repeats)
    profile_cfg = GenerationConfig(max_new_tokens=24, stop_token_ids=[])
    return {
        "size": size,
        "device": device,
        "rows": num_rows,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tokens_per_s": speeds,
        "static_over_eager": speeds["static"] / speeds["eager"],
        "profile": {loop: profile_steps(model, tokenizer, batch, profile_cfg, loop, 16) for loop in speeds},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=["tiny", "0.5b"], default="tiny", help="grpo_step.py's workload")
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (the shortest: half)")
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes of each loop")
    parser.add_argument("--rows", type=int, default=None, help="rows decoded (default: the workload's)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="tokens per row (default: the workload's)"
    )
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    workload = grpo_step.WORKLOADS[args.size]
    shape = (
        args.rows or workload.num_prompts * workload.num_generations,
        args.new_tokens or workload.max_new_tokens,
    )
    result = measure(args.size, args.device, args.prompt_len, args.repeats, shape=shape)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
