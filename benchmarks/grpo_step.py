"""GRPO step benchmark: the time of every stage of a posttrain GRPO step, and the same work done by TRL's
`GRPOTrainer` (run in its own environment, `.venv-trl`: TRL is not a dependency), side by side, each as
its users run it: posttrain at its defaults, TRL at its defaults (torch's own thread count), except that
TRL runs in fp32 on a CPU (its bf16 default runs 2x slower there) and both share the same work.

Workloads (`--model`):
- `tiny`: Qwen2 architecture, hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 768, the byte-level BPE
  tokenizer (300 tokens): 3.23M parameters, seeded, fp32. 2 prompts x 8 generations of up to 64 new
  tokens, exact-match rewards on 2-digit additions.
- `smollm2`: SmolLM2-135M-Instruct (the directory `make real-model` writes, or `--model-dir`), its own
  49k-token tokenizer and ChatML template; 8 prompts x 4 generations of up to 32 new tokens ("What is
  51 - 29? Reply with the number only."), the `math` environment's rewards (the reply's final answer),
  stop at `<|im_end|>`.
- `smollm2_long`: SmolLM2-135M-Instruct on replies users train with: 8 prompts x 8 generations of up to
  512 new tokens, questions asking for step-by-step working ending in `\boxed{}` (three-number arithmetic),
  so replies are long and uneven. posttrain runs with only the keys the work needs (one optimizer step over
  the 64 samples; micro-batches, logprob batches, micro-batch planning at its defaults); TRL at its
  default micro-batch of 8 (per_device_train_batch_size 8, gradient accumulation 8: one optimizer step over
  the 64 samples, all generated at once).
- `0.5b`: a seeded Qwen2 of 477M parameters (hidden 896, 32 layers, 14 heads, 2 KV heads, MLP 4864, the
  byte tokenizer), 8 prompts x 8 generations of up to 128 new tokens: generation dominates (for GPUs).
Every step: temperature 1 (no top-k / top-p), one AdamW step over all samples (weight decay 0.01, grad-
norm clip 1), clipped policy-gradient loss, no KL. Rewards of an untrained model are mostly 0: the loss
is still computed and back-propagated, and weight decay changes every weight, so refit ships the model.

posttrain's stages come from the step's own Timer (`grpo.grpo_step`): generation (rollouts less the
environments' time), rewards (environment actors), advantages (and building the training batch),
logprobs (the trainer's recomputation of the sampling policy's logprobs, only when a step trains
several global batches or on stale data), training, refit (weights to the generation workers), other
(memory moves on GPUs, waiting). TRL's come from its profiling contexts (`transformers.generate`,
`_calculate_rewards`, `_prepare_inputs`) and step callbacks; TRL has no refit (one model does both).
Idle time of a worker group: the part of the step it does not compute (trainer: step - training -
logprobs; generation: step - generation, or in async mode the generator's wait for new weights), as the
fraction of the step. `--modes sync,async` times posttrain's synchronous loop and its asynchronous one
(generation one step ahead on workers of its own, `grpo.async_grpo`, max_trajectory_age_steps 1, each
side with half of the machine's cores) as two columns; mode `async_lent` is the asynchronous one with
`grpo.async_grpo.lend_idle_cores` (the side that waits lends its threads to the other).

For the SmolLM2 workloads the table adds the compute floor: the FLOPs of the step's work (training 6 x
matmul parameters x tokens computed, forward-and-backward; generation 2 x parameters per token, prompt
prefill included) at the machine's fp32 matmul rate, measured at the start (`measured_matmul_gflops`),
for each side's own mean reply length (`floor_s`): each framework draws its own samples, and on the long
workload the replies' mean length, so the work of a step, moves by as much as a third with the sampling seed
alone. `ratio_SIDE_over_trl` compares median steps; `ratio_SIDE_over_trl_equal_work` compares each side's
mean step over its own floor (seconds per unit of the same work);
the padding share of the positions the trainer computed (posttrain's `padding_share`); and the peak
resident memory of the trainer and the generator processes (VmHWM of the Ray actors; TRL: its process).
Mode `sync_in_order` is the synchronous step with `policy.length_bucketing: false` (rows in order); mode
`vllm` the synchronous step with vLLM generating on a worker of its own (the two groups take turns, each
with all cores; run it with the environment that has vLLM, `.venv-vllm/bin/python`, and `--skip-trl`).

Run:  make bench    or    .venv/bin/python benchmarks/grpo_step.py [--model tiny|smollm2|0.5b]
      [--device cuda] [--runs 3] [--skip-trl] [--threads N]
Writes benchmarks/results/grpo_step[_MODEL].json: medians over the timed steps of every run (warm-up steps
excluded); with --runs N the sides alternate, N runs each, so a change of machine load hits both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.algorithms import grpo
from posttrain.config import validate_config
from posttrain.data.math_steps import question_text
from posttrain.data.tasks import builtin_rows
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
from posttrain.utils.timer import Timer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_report beside this script
from step_report import (  # noqa: E402
    actor_peak_rss,
    add_floors,
    machine_description,
    matmul_gflops,
    print_table,
    side_name,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
ASYNC_MODES = ("async", "async_lent")


@dataclass
class Workload:
    """One model and the work of one GRPO step on it."""

    name: str
    num_prompts: int
    num_generations: int
    max_new_tokens: int
    env: str  # posttrain environment: exact_match (answers compared as text) or math (final answer)
    model: ModelFromConfig | None = None  # built from config; None: a model directory (--model-dir)
    optimizer: dict = field(
        default_factory=lambda: {"lr": 1.0e-5, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1.0e-8}
    )
    long: bool = False  # step-by-step replies; posttrain's default micro-batching, TRL's micro-batch of 8


WORKLOADS = {
    "tiny": Workload(
        "tiny",
        2,
        8,
        64,
        "exact_match",
        ModelFromConfig(
            architecture="qwen2",
            hidden_size=256,
            num_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=768,
            max_position_embeddings=512,
            tokenizer="byte",
            seed=0,
        ),
    ),
    "smollm2": Workload("smollm2", 8, 4, 32, "math"),
    "smollm2_long": Workload("smollm2_long", 8, 8, 512, "math", long=True),
    "0.5b": Workload(
        "0.5b",
        8,
        8,
        128,
        "exact_match",
        ModelFromConfig(
            architecture="qwen2",
            hidden_size=896,
            num_layers=32,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            max_position_embeddings=1024,
            tokenizer="byte",
            seed=0,
        ),
    ),
}


# ---------------------------------------------------------------------------------------------- inputs
def write_prompts(path: Path, workload: Workload, num_prompts: int) -> None:
    """rl rows, the same file for both frameworks, used in order: 2-digit additions (`07+85=` -> `092`)
    for the built models, questions in words for the chat model."""
    if workload.long:
        rng = random.Random(0)
        rows = []
        for _ in range(num_prompts):
            a, b, c = rng.randint(12, 99), rng.randint(3, 19), rng.randint(100, 999)
            rows.append(
                {
                    "prompt": question_text(a, b, c),
                    "answer": str(a * b + c),
                }
            )
    elif workload.name == "smollm2":
        rng = random.Random(0)
        rows = []
        for _ in range(num_prompts):
            a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
            rows.append(
                {
                    "prompt": f"What is {a} {op} {b}? Reply with the number only.",
                    "answer": str(a + b if op == "+" else a - b),
                }
            )
    else:
        rows, _ = builtin_rows("arithmetic", num_prompts, 0, seed=0)
    with open(path, "w") as f:
        for row in rows:
            f.write(
                json.dumps({"prompt": row["prompt"], "answer": row["answer"], "task_name": "arithmetic"})
                + "\n"
            )


def posttrain_config(
    workload: Workload,
    model_dir: Path,
    data_file: Path,
    log_dir: Path,
    device: str,
    threads: int | None,
    mode: str = "sync",
) -> grpo.GRPOConfig:
    batch = workload.num_prompts * workload.num_generations
    micro_batching = {} if workload.long else {"train_micro_batch_size": batch, "logprob_batch_size": batch}
    cluster: dict = {"workers_per_node": 1}  # posttrain's default bundle: the machine's cores
    if threads is not None:  # the policy and the colocated generation worker each compute with the bundle's
        cluster["num_cpus_per_worker"] = float(threads)
    if device == "cuda":  # the policy and the colocated generation worker each take half of the GPU bundle
        cluster["num_gpus_per_worker"] = 1.0
    tree = {
        "grpo": {
            "num_prompts_per_step": workload.num_prompts,
            "num_generations_per_prompt": workload.num_generations,
            "max_num_steps": 1000,
            "max_seq_len": 1024 if workload.long else 512,
            "val_period": 0,
            "val_at_start": False,
            "seed": 0,
        },
        "loss": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "reference_policy_kl_penalty": 0.0},
        "policy": {
            "model_name": str(model_dir),
            "train_global_batch_size": batch,
            **micro_batching,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "AdamW", "kwargs": workload.optimizer},
        },
        "generation": {
            "backend": "hf",
            "max_new_tokens": workload.max_new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "colocated": True,
        },
        "data": {
            "dataset": str(data_file),
            "format": "rl",
            "shuffle": False,
            "val_fraction": 0.0,
            "max_length": 256,
        },
        "env": {"arithmetic": {"cls": workload.env, "num_workers": 1}},
        "cluster": cluster,
        "logger": {"log_dir": str(log_dir), "tensorboard_enabled": False},
        "checkpointing": {"enabled": False},
    }
    if device == "cuda":  # the fastest sensible setting on a GPU, as TRL's bf16 default
        tree["policy"]["precision"] = tree["generation"]["precision"] = "bfloat16"
    if mode == "sync_in_order":  # the synchronous step with rows kept in order in the micro-batches
        tree["policy"]["length_bucketing"] = False
    if mode == "vllm":  # vLLM generation on a worker of its own (run from the environment with vLLM)
        tree["generation"].update(backend="vllm", colocated=False, num_workers=1)
        if device == "cpu":  # the two groups take turns: each computes with all of the machine's cores
            cores = threads or os.cpu_count() or 2
            tree["cluster"]["num_cpus_per_worker"] = float(cores)
            tree["generation"]["num_cpus_per_worker"] = float(cores)
            tree["cluster"]["num_cpus"] = 2 * cores + 1  # logical CPUs: both groups + environments
    if mode in ASYNC_MODES:  # generation on workers of its own, one step ahead of training
        tree["grpo"]["async_grpo"] = {
            "enabled": True,
            "max_trajectory_age_steps": 1,
            "lend_idle_cores": mode == "async_lent",  # the side that waits lends its threads
        }
        tree["loss"].update(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0)
        tree["generation"].update(colocated=False, num_workers=1)
        if device == "cpu":  # the trainer and the generator each get half of the machine's cores
            cores = max(1, (os.cpu_count() or 2) // 2)
            tree["cluster"]["num_cpus_per_worker"] = float(threads or cores)
            tree["generation"]["num_cpus_per_worker"] = float(threads or cores)
            tree["cluster"]["num_cpus"] = (
                2 * (threads or cores) + 1
            )  # logical CPUs: both groups + environments
        else:
            tree["generation"]["num_cpus_per_worker"] = 1.0
    return validate_config(grpo.GRPOConfig, tree)


# --------------------------------------------------------------------------------------------- posttrain
def posttrain_stage_times(timer: Timer, step_time: float) -> dict[str, float]:
    """The step's Timer as the table's stages; "generation" is the rollout less the environments' time
    (async: the trainer's wait for the buffer, since generation and rewards run beside training)."""
    timings = timer.get_timing_metrics(reduction="sum")
    stages = {
        name: timings.get(name, 0.0) for name in ("rewards", "advantages", "logprobs", "training", "refit")
    }
    stages["generation"] = timings.get("generation", timings.get("rollout_wait", 0.0)) - stages["rewards"]
    stages["other"] = step_time - sum(stages.values())
    return stages


def run_posttrain(
    args: argparse.Namespace, workload: Workload, model_dir: Path, data_file: Path, work_dir: Path, mode: str
) -> tuple[list[dict], dict]:
    """posttrain GRPO steps through the public API (`grpo.setup`, `grpo.grpo_step`); the timed steps."""
    log_dir = Path(tempfile.mkdtemp(prefix="posttrain_run_", dir=work_dir))
    cfg = posttrain_config(workload, model_dir, data_file, log_dir, args.device, args.threads, mode)
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
            generation_wait = metrics.get("async/generator_wait_s", 0.0)
            steps.append(
                {
                    "step": step_time,
                    "stages": posttrain_stage_times(timer, step_time),
                    "generation_busy": step_time - generation_wait if mode in ASYNC_MODES else None,
                    "mean_response_length": mean_length,
                    "generated_tokens": mean_length * workload.num_prompts * workload.num_generations,
                    "reward_mean": metrics["reward_mean"],
                    "padding_share": metrics["padding_share"],
                    "trained_tokens": metrics["num_real_tokens"],
                    "computed_tokens": metrics["num_computed_tokens"],
                }
            )
        threads = run.policy.describe()[0]["num_threads"]
        memory = {
            "trainer": peak_rss_bytes("DTensorPolicyWorker"),
            "generation": max(peak_rss_bytes("HFGenerationWorker"), peak_rss_bytes("VllmGenerationWorker")),
        }
    finally:
        run.shutdown()
    return steps[args.warmup :], {"torch_threads": threads, "peak_rss_bytes": memory}


def peak_rss_bytes(actor_class: str) -> int:
    """The largest peak resident memory of this machine's Ray actor processes of `actor_class`; 0 when none
    is found."""
    return max(actor_peak_rss(actor_class).values(), default=0)


# ------------------------------------------------------------------------------------------------- TRL
def run_trl(
    args: argparse.Namespace, workload: Workload, model_dir: Path, data_file: Path, work_dir: Path
) -> tuple[list[dict], dict]:
    """`.venv-trl/bin/python benchmarks/trl_grpo.py JOB.json OUT.json`: the timed steps and the versions."""
    job = {
        "model_dir": str(model_dir),
        "data_file": str(data_file),
        "output_dir": str(work_dir / "trl_run"),
        "device": args.device,
        "num_prompts": workload.num_prompts,
        "num_generations": workload.num_generations,
        "max_completion_length": workload.max_new_tokens,
        "temperature": 1.0,
        "optimizer": workload.optimizer,
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": 0,
        "torch_threads": args.threads,
        "numeric_answers": workload.env == "math",
        "micro_batch_size": 8 if workload.long else None,  # TRL's default per-device batch
    }
    job_file, out_file = work_dir / "trl_job.json", work_dir / "trl_result.json"
    job_file.write_text(json.dumps(job))
    command = [args.trl_python, str(ROOT / "benchmarks" / "trl_grpo.py"), str(job_file), str(out_file)]
    subprocess.run(command, check=True)
    result = json.loads(out_file.read_text())
    return result["steps"][args.warmup :], {
        "versions": result["versions"],
        "torch_threads": result["torch_threads"],
        "peak_rss_bytes": {"trainer": result["peak_rss_bytes"], "generation": result["peak_rss_bytes"]},
    }


# --------------------------------------------------------------------------------------------- report
def prepare_model(args: argparse.Namespace, workload: Workload, work_dir: Path) -> Path:
    if workload.model is not None:
        return build_model_dir(workload.model, work_dir / "model")
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        raise SystemExit(
            f"--model smollm2: no model in {model_dir}; run `make real-model` (or pass --model-dir)"
        )
    return model_dir


def mean_prompt_tokens(model_dir: Path, data_file: Path) -> float:
    """Mean length of the prompts in tokens, chat template and generation prompt included."""
    from posttrain.models.build import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    lengths = []
    for line in data_file.read_text().splitlines():
        messages = [{"role": "user", "content": json.loads(line)["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return statistics.fmean(lengths)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny", help="workload (see above)")
    parser.add_argument(
        "--model-dir",
        default=str(ROOT / "models" / "smollm2-135m-instruct"),
        help="--model smollm2: the model directory",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both frameworks run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (each side)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (each side)")
    parser.add_argument("--runs", type=int, default=1, help="runs per side, alternating (medians over all)")
    parser.add_argument("--skip-trl", action="store_true", help="time posttrain only")
    parser.add_argument(
        "--modes",
        default="sync,async",
        help="posttrain modes to time: sync, async, async_lent, sync_in_order, vllm (comma list)",
    )
    parser.add_argument(
        "--trl-python",
        default=str(ROOT / ".venv-trl" / "bin" / "python"),
        help="python of the TRL environment (make install-trl)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pin torch threads (posttrain: CPUs per bundle; TRL: torch.set_num_threads); "
        "default: each framework's own default",
    )
    parser.add_argument(
        "--out", default=None, help="JSON result (default benchmarks/results/grpo_step[_MODEL].json)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    suffix = "" if args.model == "tiny" else f"_{args.model}"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"grpo_step{suffix}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = WORKLOADS[args.model]
    with tempfile.TemporaryDirectory(prefix="grpo_step_bench_") as tmp:
        work_dir = Path(tmp)
        model_dir = prepare_model(args, workload, work_dir)
        model = load_model(str(model_dir))
        num_params = sum(p.numel() for p in model.parameters())
        config = model.config
        data_file = work_dir / "prompts.jsonl"
        write_prompts(data_file, workload, workload.num_prompts * (args.warmup + args.steps))  # used in order
        prompt_tokens = mean_prompt_tokens(model_dir, data_file)
        results: dict = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_description(args.device),
            "model": {
                "workload": workload.name,
                "architecture": config.model_type,
                "num_parameters": num_params,
                "hidden_size": config.hidden_size,
                "num_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "intermediate_size": config.intermediate_size,
                "vocab_size": config.vocab_size,
            },
            "work": {
                "num_prompts": workload.num_prompts,
                "num_generations": workload.num_generations,
                "max_new_tokens": workload.max_new_tokens,
                "temperature": 1.0,
                "reward": workload.env,
                "optimizer": {"name": "AdamW", **workload.optimizer},
                "kl": 0.0,
            },
        }
        print(
            f"model: {workload.name}, {num_params / 1e6:.2f}M parameters; {args.runs} run(s) of "
            f"{args.warmup} "
            f"warm-up + {args.steps} timed steps per side"
        )
        modes = [mode for mode in args.modes.split(",") if mode]
        runs: dict[str, list] = {side: [] for side in [side_name(m) for m in modes] + ["trl"]}
        info: dict[str, dict] = {}
        if workload.name.startswith("smollm2"):  # the machine's matmul rate, before the runs load it
            results["floor"] = {"measured_matmul_gflops": matmul_gflops(args.threads)}
        for _ in range(args.runs):  # alternate the sides, so that a change of machine load hits both
            for mode in modes:
                side = side_name(mode)
                steps, info[side] = run_posttrain(args, workload, model_dir, data_file, work_dir, mode)
                runs[side].append(steps)
            if not args.skip_trl:
                steps, info["trl"] = run_trl(args, workload, model_dir, data_file, work_dir)
                runs["trl"].append(steps)
        for side, side_runs in runs.items():
            if side_runs:
                results[side] = {**summarize(side_runs), **info[side]}
        sides = [side_name(m) for m in modes]
        for side in sides:
            if side in results and "trl" in results:
                results[f"ratio_{side}_over_trl"] = (
                    results[side]["step_time_median_s"] / results["trl"]["step_time_median_s"]
                )
        if "floor" in results and sides[0] in results:
            add_floors(results, model, prompt_tokens, workload, sides)
        results["machine"]["load_average_end"] = os.getloadavg()
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
