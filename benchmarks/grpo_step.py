"""GRPO step benchmark (issue #6): the time of every stage of a posttrain GRPO step, and the same work done
by TRL's `GRPOTrainer` (run in its own environment, `.venv-trl`: TRL is not a dependency), side by side.

Model: Qwen2 architecture, hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 768, the byte-level BPE
tokenizer (300 tokens): 3.23M parameters, seeded, fp32. Work per step: 2 prompts x 8 generations of up to
64 new tokens (temperature 1, no top-k / top-p), exact-match rewards on 2-digit additions, one AdamW step
over the 16 samples (lr 1e-5, weight decay 0.01, grad-norm clip 1), clipped policy-gradient loss, no KL.

An untrained model never answers exactly, so every reward and advantage is 0: the work is the same as
in a real run (the loss is still computed and back-propagated), and the weight decay changes every weight
each step, so posttrain's refit ships the whole model as it would after a real update.

posttrain's stages come from the step's own Timer (`grpo.grpo_step`): generation (rollouts less the
environments' time), rewards (environment actors), advantages (and building the training batch),
logprobs (the trainer's recomputation of the sampling policy's logprobs, only when a step trains
several global batches: not here), training, refit (weights to the generation workers). TRL's come from
its own profiling contexts (`transformers.generate`, `_calculate_rewards`, `_prepare_inputs`) and step
callbacks; TRL skips the logprob recomputation when generation and optimisation are aligned (as here)
and has no refit (one model does both).

On CPU both sides run with the same number of torch threads per process (`--threads`, default 1: Ray
gives each posttrain worker one thread per CPU it holds). More threads than free cores make OpenMP's
spinning thread pools fight each other (posttrain's colocated workers, or TRL on a loaded machine).

Run:  make bench    or    .venv/bin/python benchmarks/grpo_step.py [--device cuda] [--runs 3] [--skip-trl]
Writes benchmarks/results/grpo_step.json: medians over the timed steps of every run (warm-up steps
excluded); with --runs N the sides alternate, N runs each, so a change of machine load hits both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.algorithms import grpo
from posttrain.config import validate_config
from posttrain.data.tasks import builtin_rows
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
from posttrain.utils.timer import Timer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelFromConfig(
    architecture="qwen2", hidden_size=256, num_layers=4, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=768, max_position_embeddings=512, tokenizer="byte", seed=0,
)
NUM_PROMPTS, NUM_GENERATIONS, MAX_NEW_TOKENS = 2, 8, 64
OPTIMIZER = {"lr": 1.0e-5, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1.0e-8}
STAGES = ("generation", "rewards", "advantages", "logprobs", "training", "refit", "other")


# ---------------------------------------------------------------------------------------------- inputs
def write_prompts(path: Path, num_prompts: int) -> None:
    """2-digit additions (`07+85=` -> `092`) as rl rows, the same file for both frameworks, used in order."""
    rows, _ = builtin_rows("arithmetic", num_prompts, 0, seed=0)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"], "task_name": "arithmetic"}) + "\n")


def posttrain_config(model_dir: Path, data_file: Path, log_dir: Path, device: str, threads: int) -> grpo.GRPOConfig:
    batch = NUM_PROMPTS * NUM_GENERATIONS
    # The policy worker and the colocated generation worker each take half of the bundle's CPUs, and Ray
    # gives an actor of N CPUs N torch threads (OMP_NUM_THREADS).
    cluster = {"workers_per_node": 1, "num_cpus_per_worker": 2.0 * threads}
    if device == "cuda":  # the policy and the colocated generation worker each take half of the GPU bundle
        cluster["num_gpus_per_worker"] = 1.0
    tree = {
        "grpo": {
            "num_prompts_per_step": NUM_PROMPTS, "num_generations_per_prompt": NUM_GENERATIONS,
            "max_num_steps": 1000, "max_seq_len": 128, "val_period": 0, "val_at_start": False, "seed": 0,
        },
        "loss": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "reference_policy_kl_penalty": 0.0},
        "policy": {
            "model_name": str(model_dir), "train_global_batch_size": batch, "train_micro_batch_size": batch,
            "logprob_batch_size": batch, "max_grad_norm": 1.0,
            "optimizer": {"name": "AdamW", "kwargs": OPTIMIZER},
        },
        "generation": {"backend": "hf", "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
                       "top_k": None, "colocated": True},
        "data": {"dataset": str(data_file), "format": "rl", "shuffle": False, "val_fraction": 0.0, "max_length": 64},
        "env": {"arithmetic": {"cls": "exact_match", "num_workers": 1}},
        "cluster": cluster,
        "logger": {"log_dir": str(log_dir), "tensorboard_enabled": False},
        "checkpointing": {"enabled": False},
    }
    return validate_config(grpo.GRPOConfig, tree)


# --------------------------------------------------------------------------------------------- posttrain
def posttrain_stage_times(timer: Timer, step_time: float) -> dict[str, float]:
    """The step's Timer as the table's stages; "generation" is the rollout less the environments' time."""
    timings = timer.get_timing_metrics(reduction="sum")
    stages = {name: timings.get(name, 0.0) for name in ("rewards", "advantages", "logprobs", "training", "refit")}
    stages["generation"] = timings.get("generation", 0.0) - stages["rewards"]
    stages["other"] = step_time - sum(stages.values())
    return stages


def run_posttrain(args: argparse.Namespace, model_dir: Path, data_file: Path, work_dir: Path) -> list[dict]:
    """posttrain GRPO steps through the public API (`grpo.setup`, `grpo.grpo_step`); the timed steps."""
    log_dir = Path(tempfile.mkdtemp(prefix="posttrain_run_", dir=work_dir))
    cfg = posttrain_config(model_dir, data_file, log_dir, args.device, args.threads)
    run = grpo.setup(cfg)
    steps = []
    try:
        for _ in range(args.warmup + args.steps):
            timer = Timer()
            start = time.perf_counter()
            metrics = grpo.grpo_step(run, timer)
            run.step += 1
            step_time = time.perf_counter() - start
            mean_length = metrics["rollout/mean_generated_length"]
            steps.append({"step": step_time, "stages": posttrain_stage_times(timer, step_time),
                          "mean_response_length": mean_length,
                          "generated_tokens": mean_length * NUM_PROMPTS * NUM_GENERATIONS,
                          "reward_mean": metrics["reward_mean"]})
    finally:
        run.shutdown()
    return steps[args.warmup:]


# ------------------------------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, model_dir: Path, data_file: Path, work_dir: Path) -> tuple[list[dict], dict]:
    """`.venv-trl/bin/python benchmarks/trl_grpo.py JOB.json OUT.json`: the timed steps and the versions."""
    job = {
        "model_dir": str(model_dir), "data_file": str(data_file), "output_dir": str(work_dir / "trl_run"),
        "device": args.device, "num_prompts": NUM_PROMPTS, "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_NEW_TOKENS, "temperature": 1.0, "optimizer": OPTIMIZER,
        "max_grad_norm": 1.0, "epsilon": 0.2, "warmup": args.warmup, "steps": args.steps, "seed": 0,
        "torch_threads": args.threads,
    }
    job_file, out_file = work_dir / "trl_job.json", work_dir / "trl_result.json"
    job_file.write_text(json.dumps(job))
    command = [args.trl_python, str(ROOT / "benchmarks" / "trl_grpo.py"), str(job_file), str(out_file)]
    subprocess.run(command, check=True)
    result = json.loads(out_file.read_text())
    return result["steps"][args.warmup:], {"versions": result["versions"], "torch_threads": result["torch_threads"]}


# --------------------------------------------------------------------------------------------- report
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
        "mean_response_length": statistics.fmean(s["mean_response_length"] for s in steps),
        "generated_tokens_per_s": median(s["generated_tokens"] / s["stages"]["generation"] for s in steps),
        "steps": steps,
    }


def print_table(results: dict) -> None:
    sides = [name for name in ("posttrain", "trl") if name in results]
    print(f"\n{'median seconds per step':<26}" + "".join(f"{side:>12}" for side in sides))
    for stage in STAGES:
        print(f"  {stage:<24}" + "".join(f"{results[s]['stage_time_median_s'][stage]:>12.3f}" for s in sides))
    print(f"{'step':<26}" + "".join(f"{results[s]['step_time_median_s']:>12.3f}" for s in sides))
    print(f"{'generated tokens / s':<26}" + "".join(f"{results[s]['generated_tokens_per_s']:>12.0f}" for s in sides))
    print(f"{'mean response length':<26}" + "".join(f"{results[s]['mean_response_length']:>12.1f}" for s in sides))
    for side in sides:
        per_run = ", ".join(f"{t:.3f}" for t in results[side]["step_time_median_s_per_run"])
        print(f"{side} step, median of each run: {per_run}")
    load = results["machine"]
    print(f"load average (1 min) at start / end: {load['load_average_start'][0]:.1f} / {load['load_average_end'][0]:.1f}")
    if "ratio_trl_over_posttrain" in results:
        print(f"\nTRL step time / posttrain step time = {results['ratio_trl_over_posttrain']:.2f}")


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def machine_description(device: str) -> dict:
    info = {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device,
            "load_average_start": os.getloadavg()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both frameworks run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (each side)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (each side)")
    parser.add_argument("--runs", type=int, default=1, help="runs per side, alternating (medians over all)")
    parser.add_argument("--skip-trl", action="store_true", help="time posttrain only")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                        help="python of the TRL environment (make install-trl)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each posttrain worker and of the TRL process")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo_step.json"), help="JSON result")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    with tempfile.TemporaryDirectory(prefix="grpo_step_bench_") as tmp:
        work_dir = Path(tmp)
        model_dir = build_model_dir(MODEL, work_dir / "model")
        num_params = sum(p.numel() for p in load_model(model_dir).parameters())
        data_file = work_dir / "prompts.jsonl"
        write_prompts(data_file, NUM_PROMPTS * (args.warmup + args.steps))  # each run uses them in order
        results: dict = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_description(args.device),
            "model": {"architecture": MODEL.architecture, "num_parameters": num_params, "hidden_size": MODEL.hidden_size,
                      "num_layers": MODEL.num_layers, "num_attention_heads": MODEL.num_attention_heads,
                      "num_key_value_heads": MODEL.num_key_value_heads, "intermediate_size": MODEL.intermediate_size,
                      "tokenizer": MODEL.tokenizer, "vocab_size": 300},
            "work": {"num_prompts": NUM_PROMPTS, "num_generations": NUM_GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS,
                     "temperature": 1.0, "reward": "exact match", "optimizer": {"name": "AdamW", **OPTIMIZER},
                     "kl": 0.0},
        }
        print(f"model: {num_params / 1e6:.2f}M parameters; {args.runs} run(s) of {args.warmup} warm-up + "
              f"{args.steps} timed steps per side")
        posttrain_runs, trl_runs, trl_info = [], [], {}
        for _ in range(args.runs):  # alternate the sides, so that a change of machine load hits both
            posttrain_runs.append(run_posttrain(args, model_dir, data_file, work_dir))
            if not args.skip_trl:
                steps, trl_info = run_trl(args, model_dir, data_file, work_dir)
                trl_runs.append(steps)
        results["posttrain"] = {**summarize(posttrain_runs), "torch_threads": args.threads}
        if trl_runs:
            results["trl"] = {**summarize(trl_runs), **trl_info}
            results["ratio_trl_over_posttrain"] = (
                results["trl"]["step_time_median_s"] / results["posttrain"]["step_time_median_s"]
            )
        results["machine"]["load_average_end"] = os.getloadavg()
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
