"""The GRPO step benchmark's arithmetic and report (benchmarks/grpo_step.py): medians over timed steps, idle
shares, the compute floor of a step's work at the machine's measured matmul rate, the printed table and the
machine's description."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpo_step import Workload

STAGES = ("generation", "rewards", "advantages", "logprobs", "training", "refit", "other")


def idle_fractions(step: dict) -> dict[str, float]:
    """The share of the step each worker group does not compute (trainer, generation)."""
    stages = step["stages"]
    generation_busy = step.get("generation_busy")
    busy = {
        "trainer": stages["training"] + stages["logprobs"],
        "generation": stages["generation"] if generation_busy is None else generation_busy,
    }
    return {group: max(0.0, 1.0 - seconds / step["step"]) for group, seconds in busy.items()}


def summarize(runs: list[list[dict]]) -> dict:
    """Medians over the timed steps of every run; tokens/s = generated tokens / generation seconds."""
    median = statistics.median
    steps = [step for run in runs for step in run]
    return {
        "num_runs": len(runs),
        "num_timed_steps": len(steps),
        "step_time_median_s": median(s["step"] for s in steps),
        "step_time_median_s_per_run": [median(s["step"] for s in run) for run in runs],
        "stage_time_median_s": {name: median(s["stages"][name] for s in steps) for name in STAGES},
        "idle_fraction_median": {
            group: median(idle_fractions(s)[group] for s in steps) for group in ("trainer", "generation")
        },
        "step_time_mean_s": statistics.fmean(s["step"] for s in steps),
        "mean_response_length": statistics.fmean(s["mean_response_length"] for s in steps),
        "generated_tokens_per_s": median(
            s["generated_tokens"] / (s.get("generation_busy") or s["stages"]["generation"]) for s in steps
        ),
        "padding_share_median": median(s.get("padding_share", float("nan")) for s in steps),
        # async: the share of the generator's busy time the trainer did not wait for (hidden behind training)
        "generation_hidden_share_median": median(
            max(0.0, 1.0 - (s["stages"]["generation"] + s["stages"]["rewards"]) / s["generation_busy"])
            if s.get("generation_busy")
            else 0.0
            for s in steps
        ),
        "steps": steps,
    }


def side_name(mode: str) -> str:
    return "posttrain" if mode == "sync" else f"posttrain_{mode}"


def matmul_gflops(threads: int | None) -> float:
    """The best of 5 fp32 2048x2048 matmuls at torch's thread count (or `threads`), in GFLOP/s."""
    if threads is not None:
        torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def compute_floor(
    model: torch.nn.Module, prompt_tokens: float, workload: Workload, mean_response_length: float
) -> dict:
    """FLOPs of the step's work and their seconds at the measured matmul rate: training is forward and
    backward (6 FLOPs per parameter per token) of every sample's prompt and reply through the linear layers
    (the output layer at reply tokens only: no loss reads a prompt's logits); generation is 2 FLOPs per
    parameter per token: each distinct prompt's prefill and every generated token. Attention is left out
    (under 5% of the linear layers' FLOPs at these lengths)."""
    head = model.get_output_embeddings().weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    body = linear - head  # the output layer is an nn.Linear too (tied or not)
    samples = workload.num_prompts * workload.num_generations
    reply_tokens = mean_response_length * samples
    train = 6 * (body * (prompt_tokens * samples + reply_tokens) + head * reply_tokens)
    generation = 2 * (body * prompt_tokens * workload.num_prompts + (body + head) * reply_tokens)
    return {"training_tflop": train / 1e12, "generation_tflop": generation / 1e12}


def add_floors(
    results: dict, model: torch.nn.Module, prompt_tokens: float, workload: Workload, sides: list[str]
) -> None:
    """The compute floor of each side's own work (`floor_s`) and each step over it; `results["floor"]`
    keeps the split for the first posttrain side. With TRL: the ratio at equal work, each side's mean step
    over its own floor."""
    rate = results["floor"]["measured_matmul_gflops"] / 1e3  # TFLOP/s
    for side in sides + (["trl"] if "trl" in results else []):
        floor = compute_floor(model, prompt_tokens, workload, results[side]["mean_response_length"])
        results[side]["floor_s"] = (floor["training_tflop"] + floor["generation_tflop"]) / rate
        results[f"ratio_{side}_over_floor"] = results[side]["step_time_median_s"] / results[side]["floor_s"]
        if side == sides[0]:
            results["floor"].update(floor, mean_prompt_tokens=prompt_tokens)
            results["floor"]["training_s"] = floor["training_tflop"] / rate
            results["floor"]["generation_s"] = floor["generation_tflop"] / rate
    if "trl" in results:
        trl = results["trl"]["step_time_mean_s"] / results["trl"]["floor_s"]
        for side in sides:
            results[f"ratio_{side}_over_trl_equal_work"] = (
                results[side]["step_time_mean_s"] / results[side]["floor_s"] / trl
            )


def print_table(results: dict) -> None:
    sides = [name for name in results if name.startswith("posttrain") or name == "trl"]

    def row(label: str, values: list, spec: str) -> None:
        print(
            f"{label:<26}"
            + "".join(f"{'—' if value is None else format(value, spec):>16}" for value in values)
        )

    row("\nmedian seconds per step", sides, "")
    for stage in STAGES:
        row(f"  {stage}", [results[s]["stage_time_median_s"][stage] for s in sides], ".3f")
    row("step", [results[s]["step_time_median_s"] for s in sides], ".3f")
    for group in ("trainer", "generation"):
        row(f"{group} idle (share)", [results[s]["idle_fraction_median"][group] for s in sides], ".2f")
    row("generated tokens / s", [results[s]["generated_tokens_per_s"] for s in sides], ".0f")
    row("mean response length", [results[s]["mean_response_length"] for s in sides], ".1f")
    row("torch threads", [results[s]["torch_threads"] for s in sides], "")
    row(
        "padding share (trained)",
        [results[s].get("padding_share_median", float("nan")) for s in sides],
        ".3f",
    )
    hidden = [results[s].get("generation_hidden_share_median", 0.0) for s in sides]
    row("generation hidden (async)", hidden, ".2f")
    if all("peak_rss_bytes" in results[s] for s in sides):
        for group in ("trainer", "generation"):
            row(
                f"{group} peak RSS (GiB)", [results[s]["peak_rss_bytes"][group] / 2**30 for s in sides], ".2f"
            )
    if "floor" in results:
        floor = results["floor"]
        print(
            f"compute floor at {floor['measured_matmul_gflops']:.0f} GFLOP/s: training "
            f"{floor['training_s']:.1f} s, generation {floor['generation_s']:.1f} s "
            f"(of posttrain's work; {floor['training_tflop']:.2f} + {floor['generation_tflop']:.2f} TFLOP)"
        )
        for side in sides:
            print(
                f"{side} step / compute floor of its own work ({results[side]['floor_s']:.1f} s) = "
                f"{results[f'ratio_{side}_over_floor']:.2f}"
            )
    for side in sides:
        per_run = ", ".join(f"{t:.3f}" for t in results[side]["step_time_median_s_per_run"])
        print(f"{side} step, median of each run: {per_run}")
    load = results["machine"]
    print(
        f"load average (1 min) at start / end: {load['load_average_start'][0]:.1f} / "
        f"{load['load_average_end'][0]:.1f}"
    )
    for side in sides:
        if f"ratio_{side}_over_trl" in results:
            print(f"{side} step time / TRL step time = {results[f'ratio_{side}_over_trl']:.2f}")
        if f"ratio_{side}_over_trl_equal_work" in results:
            print(
                f"{side} / TRL at equal work (mean step over own floor) = "
                f"{results[f'ratio_{side}_over_trl_equal_work']:.2f}"
            )


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def machine_description(device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "load_average_start": os.getloadavg(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def actor_peak_rss(actor_class: str) -> dict[int, int]:
    """Peak resident memory (VmHWM, bytes) of each live Ray actor process of `actor_class` on this machine,
    by pid (Ray titles them `ray::CLASS` or `ray::CLASS.method`)."""
    peaks = {}
    for status_file in Path("/proc").glob("[0-9]*/status"):
        try:
            title = (status_file.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            status = status_file.read_text()
        except OSError:
            continue
        if title.split(".")[0].split(" ")[0] == f"ray::{actor_class}":
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            peaks[int(status_file.parent.name)] = int(match.group(1)) * 1024 if match else 0
    return peaks
