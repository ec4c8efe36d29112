"""`posttrain demo` / `make demo`: the main job, offline on a CPU in a few minutes.

1. Build a tiny Llama-architecture model (~1M parameters) with the built-in character tokenizer.
2. SFT it on `sft_num_train` labelled examples of the built-in 2-digit addition task until greedy
   validation accuracy reaches `sft_target_accuracy` (checked every `sft_check_every` steps, at most
   `sft_max_steps`).
3. GRPO from that model on 8000 other prompts, which carry no labels: the exact-match verifier grades
   the replies. Validation every `grpo_val_period` steps; `grpo_async=true` runs it as asynchronous GRPO
   (generation on a worker of its own, overlapping training, trajectories at most
   `grpo_max_trajectory_age` steps old, truncated IS correction).
4. The control (`sft_control`): SFT continued from the same model on its labelled examples for the
   GRPO stage's training time, so that the GRPO gain stands beside what the same time gives otherwise.
This is the setting RL is for: a verifier for many prompts, labels for few. With labels for every
prompt, more SFT beats GRPO here (docs/real-model.md has the measurements).
Writes a run directory with the runs (config, metrics.jsonl, TensorBoard, checkpoints, validation
samples), `curves.png` (reward and accuracy over steps) and `summary.json` (validation accuracy of the
untrained model, after SFT, after GRPO and of the control, and the time of each stage)."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from posttrain.algorithms import grpo, sft
from posttrain.config import COMMAND_LINE, load_typed_config, parse_overrides, validate_config
from posttrain.data import load_datasets
from posttrain.distributed.virtual_cluster import join_ray, start_local_ray
from posttrain.environments import EnvironmentConfig, create_environments
from posttrain.evals.validate import run_validation
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.utils.plot import metric_series, plot_curves, read_metrics
from posttrain.workers.generation import GenerationConfig, make_generation


@dataclass
class DemoConfig:
    """Knobs of the demo (override with `posttrain demo key=value`)."""

    seed: int = 0
    """seed of the model, data and sampling"""
    num_digits: int = 2
    """digits per operand of the addition task"""
    num_val: int = 400
    """validation prompts (never trained on)"""
    sft_target_accuracy: float = 0.35
    """stop SFT at this greedy val accuracy"""
    sft_check_every: int = 25
    """SFT steps between accuracy checks"""
    sft_max_steps: int = 600
    """most SFT steps"""
    sft_lr: float = 2e-3
    """SFT learning rate"""
    sft_num_train: int = 256
    """labelled examples SFT trains on (GRPO's 8000 prompts have none)"""
    sft_control: bool = True
    """continue SFT for GRPO's training time and report it beside GRPO"""
    grpo_steps: int = 150
    """GRPO steps"""
    grpo_lr: float = 3e-4
    """GRPO learning rate"""
    grpo_val_period: int = 25
    """GRPO validation period"""
    num_prompts_per_step: int = 32
    """GRPO prompts per step"""
    num_generations_per_prompt: int = 8
    """GRPO samples per prompt"""
    grpo_async: bool = False
    """asynchronous GRPO (generation overlaps training)"""
    grpo_max_trajectory_age: int = 1
    """async GRPO: most steps a trajectory is old"""


TINY_MODEL = ModelFromConfig(
    architecture="llama",
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    intermediate_size=512,
    max_position_embeddings=64,
)


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load_stage_config(schema: type, stage: str, values: dict[str, Any]) -> Any:
    """`configs/demo_<stage>.yaml` with `values` set over it, loaded and validated like any run's config."""
    overrides = [f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}" for key, v in values.items()]
    return load_typed_config(schema, CONFIGS / f"demo_{stage}.yaml", overrides)


def data_values(cfg: DemoConfig) -> dict[str, Any]:
    return {"data.num_digits": cfg.num_digits, "data.num_val": cfg.num_val, "data.seed": cfg.seed}


def sft_config(cfg: DemoConfig, out: Path, model_dir: Path, control: bool = False) -> sft.SFTConfig:
    """The SFT stage's config; `control`: the control's, from the SFT model (no warm-up, no step cap)."""
    values = {
        "policy.model_name": model_dir,
        "logger.log_dir": out,
        "sft.max_num_steps": 10**6 if control else cfg.sft_max_steps,
        "sft.val_period": cfg.sft_check_every,
        "policy.optimizer.kwargs.lr": cfg.sft_lr,
        "policy.seed": cfg.seed,
        "data.num_train": cfg.sft_num_train,
        **data_values(cfg),
    }
    if control:
        values["policy.scheduler.0.kwargs.start_factor"] = 1.0
    return load_stage_config(sft.SFTConfig, "sft", values)


def grpo_config(cfg: DemoConfig, out: Path, model_dir: Path) -> grpo.GRPOConfig:
    """The GRPO stage's config. Async: generation on a worker of its own, stale samples weighted by the
    truncated importance-sampling ratio."""
    num_samples = cfg.num_prompts_per_step * cfg.num_generations_per_prompt
    values = {
        "policy.model_name": model_dir,
        "logger.log_dir": out / "grpo",
        "grpo.num_prompts_per_step": cfg.num_prompts_per_step,
        "grpo.num_generations_per_prompt": cfg.num_generations_per_prompt,
        "grpo.max_num_steps": cfg.grpo_steps,
        "grpo.val_period": cfg.grpo_val_period,
        "grpo.max_val_samples": cfg.num_val,
        "grpo.seed": cfg.seed,
        "grpo.async_grpo.enabled": cfg.grpo_async,
        "grpo.async_grpo.max_trajectory_age_steps": cfg.grpo_max_trajectory_age,
        "loss.use_importance_sampling_correction": cfg.grpo_async,
        "loss.truncated_importance_sampling_ratio": 2.0 if cfg.grpo_async else None,
        "policy.train_global_batch_size": num_samples,
        "policy.train_micro_batch_size": num_samples,
        "policy.logprob_batch_size": num_samples,
        "policy.optimizer.kwargs.lr": cfg.grpo_lr,
        "policy.seed": cfg.seed,
        "generation.seed": cfg.seed,
        "generation.colocated": not cfg.grpo_async,
        **data_values(cfg),
    }
    return load_stage_config(grpo.GRPOConfig, "grpo", values)


class AccuracyProbe:
    """Greedy validation accuracy of a policy's current weights (a colocated HF generation worker)."""

    def __init__(self, run: sft.SFTRun, cfg: DemoConfig):
        _, self.val_records, _ = load_datasets(
            grpo_config(cfg, Path("unused"), Path("unused")).data, run.tokenizer
        )
        self.generation = make_generation(
            run.cluster, GenerationConfig(max_new_tokens=8), run.cfg.policy.model_name
        )
        self.envs = create_environments({"arithmetic": EnvironmentConfig(cls="exact_match", num_workers=0)})
        self.run = run

    def accuracy(self, refit: bool = True) -> float:
        if refit:
            self.generation.update_weights(self.run.policy.get_weights(only_changed=True))
        result = run_validation(
            self.generation, self.val_records, self.run.tokenizer, self.envs, max_seq_len=32
        )
        return result.metrics["accuracy"]

    def shutdown(self) -> None:
        for env in self.envs.values():
            env.shutdown()
        self.generation.shutdown()


def run_sft_stage(cfg: DemoConfig, out: Path, model_dir: Path) -> dict[str, Any]:
    run = sft.setup(sft_config(cfg, out / "sft", model_dir))
    probe = AccuracyProbe(run, cfg)
    curve = [(0, probe.accuracy(refit=False))]
    print(f"[demo] untrained model: greedy validation accuracy {curve[0][1]:.3f}")
    while run.step < run.total_steps and curve[-1][1] < cfg.sft_target_accuracy:
        sft.sft_train(run, num_steps=cfg.sft_check_every)
        curve.append((run.step, probe.accuracy()))
        print(f"[demo] sft step {run.step}: greedy validation accuracy {curve[-1][1]:.3f}")
    run.policy.export_hf(str(out / "sft" / "hf_model"))
    probe.shutdown()
    run.shutdown()
    return {
        "untrained_accuracy": curve[0][1],
        "sft_accuracy": curve[-1][1],
        "sft_steps": run.step,
        "sft_accuracy_curve": curve,
    }


def run_grpo_stage(cfg: DemoConfig, out: Path) -> dict[str, Any]:
    run = grpo.setup(grpo_config(cfg, out, out / "sft" / "hf_model"))
    start_accuracy = grpo.validate(run, 0)["accuracy"]
    final = grpo.grpo_train(run)
    run.policy.export_hf(str(out / "grpo" / "hf_model"))
    run.shutdown()
    records = read_metrics(out / "grpo" / "metrics.jsonl")
    steps, step_times = metric_series(records, "train/step_time")
    trained_by_step = dict(zip(steps, itertools.accumulate(step_times)))
    val_steps, val_accuracy = metric_series(records, "val/accuracy")
    by_time = [(0.0, start_accuracy)] + [
        (trained_by_step[s], a) for s, a in zip(val_steps, val_accuracy) if s in trained_by_step
    ]
    return {
        "grpo_start_accuracy": start_accuracy,
        "grpo_accuracy_by_time": by_time,
        "grpo_accuracy": final["accuracy"],
        "grpo_steps": run.step,
        "grpo_train_s": sum(metric_series(records, "train/step_time")[1]),
        "grpo_async": cfg.grpo_async,
    }


def run_sft_control(cfg: DemoConfig, out: Path, seconds: float) -> dict[str, Any]:
    """SFT continued from the SFT stage's model on the same labelled examples until its training time
    (validation excluded) reaches `seconds`, GRPO's; greedy accuracy on the same held-out prompts at each
    quarter of that time (its curve against training seconds, like GRPO's)."""
    run = sft.setup(sft_config(cfg, out / "sft_control", out / "sft" / "hf_model", control=True))
    probe = AccuracyProbe(run, cfg)
    trained, by_time = 0.0, [(0.0, probe.accuracy(refit=False))]
    while trained < seconds and run.step < run.total_steps:
        start = time.perf_counter()
        sft.sft_train(run, num_steps=cfg.sft_check_every)
        trained += time.perf_counter() - start
        if trained >= seconds * len(by_time) / 4 or trained >= seconds:
            by_time.append((trained, probe.accuracy()))
    probe.shutdown()
    run.shutdown()
    return {
        "sft_control_accuracy": by_time[-1][1],
        "sft_control_steps": run.step,
        "sft_control_train_s": trained,
        "sft_control_accuracy_by_time": by_time,
    }


def columns(points: list) -> tuple[list, list]:
    """[(x, y), ...] -> ([x, ...], [y, ...])."""
    return [x for x, _ in points], [y for _, y in points]


def plot_demo(out: Path, summary: dict[str, Any]) -> Path:
    """The SFT stage's validation curve by step, GRPO's train reward by step, and GRPO's validation curve
    beside the SFT control's against seconds of training after the SFT stage."""
    records = read_metrics(out / "grpo" / "metrics.jsonl")
    after_sft = {"GRPO": summary["grpo_accuracy_by_time"]}
    if "sft_control_accuracy_by_time" in summary:
        after_sft["SFT control"] = summary["sft_control_accuracy_by_time"]
    return plot_curves(
        {
            "SFT val accuracy": columns(summary["sft_accuracy_curve"]),
            "GRPO train reward": metric_series(records, "train/reward_mean"),
            "val accuracy after SFT": {name: columns(points) for name, points in after_sft.items()},
        },
        out / "curves.png",
        title="posttrain demo: 2-digit addition",
        xlabels={"val accuracy after SFT": "training seconds after the SFT stage"},
    )


def run_demo(cfg: DemoConfig, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = not ray.is_initialized()
    if started and os.environ.get("RAY_ADDRESS"):
        join_ray(os.environ["RAY_ADDRESS"], log_to_driver=False)
    elif started:
        start_local_ray(4, log_to_driver=False)
    summary: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        model_dir = build_model_dir(TINY_MODEL, out / "initial_model")
        t1 = time.perf_counter()
        summary.update(run_sft_stage(cfg, out, model_dir))
        t2 = time.perf_counter()
        summary.update(run_grpo_stage(cfg, out))
        t3 = time.perf_counter()
        if cfg.sft_control:
            summary.update(run_sft_control(cfg, out, summary["grpo_train_s"]))
    finally:
        if started:
            ray.shutdown()
    summary["wall_time_s"] = {"build_model": t1 - t0, "sft": t2 - t1, "grpo": t3 - t2, "total": t3 - t0}
    summary["grpo_gain_points"] = 100 * (summary["grpo_accuracy"] - summary["sft_accuracy"])
    summary["curves_png"] = str(plot_demo(out, summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(args: Any) -> int:
    overrides = {override.key: override.value for override in parse_overrides(args.overrides)}
    cfg = validate_config(DemoConfig, overrides, dict.fromkeys(overrides, COMMAND_LINE))
    out = Path(args.out or f"results/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_demo(cfg, out)
    print(
        f"\nvalidation accuracy: untrained {summary['untrained_accuracy']:.3f} -> after SFT "
        f"{summary['sft_accuracy']:.3f} -> after GRPO {summary['grpo_accuracy']:.3f} "
        f"({summary['grpo_gain_points']:+.1f} points from GRPO)"
    )
    if cfg.sft_control:
        print(
            f"control: SFT continued for GRPO's {summary['grpo_train_s']:.0f} s of training "
            f"({summary['sft_control_steps']} steps on the same {cfg.sft_num_train} labelled examples): "
            f"{summary['sft_control_accuracy']:.3f}"
        )
    print(
        f"wall time: {summary['wall_time_s']['total']:.0f}s; summary {out / 'summary.json'}; plot "
        f"{summary['curves_png']}; TensorBoard: tensorboard --logdir {out}"
    )
    return 0
