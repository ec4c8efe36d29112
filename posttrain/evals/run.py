"""`posttrain eval`: score a model (Hugging Face directory or hub name, exported or posttrain checkpoint, or
a from-config model) on every row of a dataset (or its validation slice, `eval.records: validation`)
with pass@k or cons@k. Rollouts and scoring go
through `run_validation`, the code GRPO validates with, so both report the same accuracy.

Run: posttrain eval --config configs/eval_tiny.yaml eval.save_path=results/my-eval"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.table import Table

from posttrain.config import ConfigError, load_run_config, save_config
from posttrain.data import DataConfig, load_all_records, load_datasets
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.environments import EnvironmentConfig, create_environments, tool_prompts
from posttrain.environments.registry import (
    check_record_tasks,
    default_task_name,
    environment_file_problems,
    match_task_to_environments,
)
from posttrain.evals.graders import grader_problems, summarize_strict_grades
from posttrain.evals.metrics import eval_cons_k, eval_pass_k
from posttrain.evals.validate import SamplingSettings, ValidationResult, run_validation
from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer
from posttrain.models.vlm import processor_for
from posttrain.utils.logger import Logger, LoggerConfig
from posttrain.utils.progress import StepProgress
from posttrain.workers.generation import GenerationConfig, make_generation
from posttrain.workers.policy.on_disk import find_policy_checkpoint, hf_model_dir


@dataclass
class EvalSettings(SamplingSettings):
    """What is measured and where the results go (section `eval`): the sampling and grading of GRPO's
    validation (`SamplingSettings`), and the evaluation's own keys."""

    metric: Literal["pass@k", "cons@k"] = "pass@k"
    """pass@k (unbiased estimator) or cons@k (majority vote over k samples)"""
    seed: int = 42
    """seed of the sampling (and of cons@k's subset draws)"""
    save_path: str = ""
    """output directory ('' : results/eval-<time>)"""
    records: Literal["all", "validation"] = "all"
    """all: every row of data.val_dataset if set, else of data.dataset (a built-in task: its validation
    rows); validation: the slice training validates on (data.val_fraction)"""
    max_samples: int | None = None
    """evaluate only the first this many prompts"""
    batch_size: int = 256
    """prompts per generation round (one progress step)"""
    max_seq_len: int = 256
    """most tokens of a conversation; longer is truncated"""
    max_rollout_turns: int = 1
    """turns per episode (1: single-turn)"""

    def validate(self) -> None:
        super().validate()
        for name in ("max_samples", "batch_size", "max_seq_len", "max_rollout_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, f"must be >= 1, got {value}")


@dataclass
class EvalModelConfig:
    """The evaluated model (section `model`): exactly one of model_name and from_config."""

    model_name: str | None = None
    """HF model directory or hub name, exported checkpoint, or a run's checkpoints/step_N"""
    tokenizer_name: str | None = None
    """tokenizer (None: the model's own)"""
    from_config: ModelFromConfig | None = None
    """a seeded random model with the character tokenizer (offline)"""

    def validate(self) -> None:
        if (self.model_name is None) == (self.from_config is None):
            raise ConfigError("model_name", "set exactly one of model.model_name and model.from_config")


@dataclass
class EvalConfig:
    """`posttrain eval` configuration."""

    eval: EvalSettings = field(default_factory=EvalSettings)
    """metric, samples, output"""
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    """the evaluated model"""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """sampling and backend"""
    data: DataConfig = field(default_factory=DataConfig)
    """dataset: every row is scored (eval.records: all), or its validation slice"""
    env: dict[str, EnvironmentConfig] = field(default_factory=lambda: {"arithmetic": EnvironmentConfig()})
    """task name -> environment"""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray cluster and placement"""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """where the results are logged, as in training (log_dir None: eval.save_path)"""

    def __post_init__(self) -> None:
        default_task_name(self.data, self.env)

    def validate(self) -> None:
        match_task_to_environments(self.data, self.env)

    def missing_files(self) -> list[ConfigError]:
        """Missing data files, model directory, reward and environment files and grader file, one error
        each (run before anything starts)."""
        problems = self.data.missing_files()
        try:
            check_model_source(self.model)
        except ConfigError as error:
            problems.append(error)
        return (
            problems + environment_file_problems(self.env) + grader_problems("eval.grader", self.eval.grader)
        )


def check_model_source(model_cfg: EvalModelConfig) -> None:
    """Fail before anything starts when model_name is a local path that does not exist or holds no model
    (a name that is not a local path is a hub name, left to the loader)."""
    if model_cfg.model_name is None:
        return
    path = Path(model_cfg.model_name)
    if model_cfg.model_name.startswith(("/", "./", "../")) and not path.exists():
        raise ConfigError("model.model_name", f"{model_cfg.model_name} does not exist")
    if not path.is_dir():
        return
    if not (path / "config.json").is_file() and find_policy_checkpoint(path) is None:
        raise ConfigError(
            "model.model_name",
            f"{path} is neither a Hugging Face model directory (no config.json) nor a posttrain checkpoint "
            "(no model/, lora/ or megatron/ under it or under its policy/); for a run, name one of its "
            "checkpoints/step_N",
        )


def materialize_model(model_cfg: EvalModelConfig, scratch_dir: Path) -> Path | str:
    """A Hugging Face directory or hub name to load: builds a from-config model, or exports a posttrain
    checkpoint, into `scratch_dir`; a `.gguf` file gives its cached plain directory; anything else is
    returned as given."""
    if model_cfg.from_config is not None:
        return build_model_dir(model_cfg.from_config, scratch_dir / "model")
    return hf_model_dir(model_cfg.model_name, scratch_dir, key="model.model_name")


def describe_model(model_cfg: EvalModelConfig) -> str:
    if model_cfg.model_name is not None:
        return model_cfg.model_name
    arch = model_cfg.from_config
    return (
        f"from_config({arch.architecture}, hidden {arch.hidden_size}, {arch.num_layers} layers, seed "
        f"{arch.seed})"
    )


def load_eval_records(cfg: EvalConfig, tokenizer: Any, processor: Any = None) -> list[dict]:
    """The records `eval.records` picks from `cfg.data` (all, or the validation slice; the first
    `eval.max_samples`), checked against `cfg.env`; `processor`: a vision-language model's, for rows with
    images."""
    prompts = tool_prompts(cfg.env)
    if cfg.eval.records == "all":
        records = load_all_records(cfg.data, tokenizer, processor, prompts)
    else:
        records = load_datasets(cfg.data, tokenizer, processor, prompts)[1]
    records = records[: cfg.eval.max_samples] if cfg.eval.max_samples else records
    if not records:
        raise ConfigError(
            "data", f"{cfg.data.dataset} has no records to evaluate (eval.records={cfg.eval.records})"
        )
    check_record_tasks(records, cfg.env, cfg.data)
    return records


def merge_results(parts: list[ValidationResult]) -> ValidationResult:
    """One result from per-batch results (rewards and samples concatenated in order, metrics re-weighted)."""
    rewards = torch.cat([p.rewards for p in parts])
    samples = [s for p in parts for s in p.samples]
    num_generated = sum(p.metrics["mean_generated_length"] * p.metrics["num_samples"] for p in parts)
    metrics = {
        "accuracy": float(rewards.mean()),
        "mean_generated_length": num_generated / len(samples),
        "truncation_rate": sum(s["truncated"] for s in samples) / len(samples),
        "num_samples": float(len(samples)),
    }
    if any("strict_grade" in s for s in samples):
        metrics.update(summarize_strict_grades(samples))
    return ValidationResult(metrics, samples, rewards)


def roll_out(
    cfg: EvalSettings, generation: Any, records: list[dict], tokenizer: Any, envs: dict
) -> ValidationResult:
    """All records, n samples each, batch by batch with a progress display.

    Batch b seeds its sampling with `seed + b * batch_size`, as one `run_validation` call over all records
    would, so the result does not depend on being split here."""
    parts: list[ValidationResult] = []
    starts = range(0, len(records), cfg.batch_size)
    with StepProgress("eval", len(starts)) as progress:
        for batch_index, start in enumerate(starts):
            part = run_validation(
                generation,
                records[start : start + cfg.batch_size],
                tokenizer,
                envs,
                cfg.max_seq_len,
                cfg.max_rollout_turns,
                settings=cfg,
                batch_size=cfg.batch_size,
                seed=cfg.seed + start,
            )
            parts.append(part)
            num_correct = sum(float(p.rewards.sum()) for p in parts)
            progress.advance(
                batch_index + 1, {"accuracy": num_correct / sum(p.rewards.numel() for p in parts)}
            )
    return merge_results(parts)


def voting_answer(answer: str | None) -> str | None:
    """The answer a sample votes with in cons@k: stripped; an empty answer does not vote."""
    if answer is None:
        return None
    return answer.strip() or None


def compute_score(cfg: EvalSettings, rewards: list[float], answers: list[str | None]) -> float:
    """pass@k or cons@k over flat per-sample rewards (each prompt's n samples contiguous)."""
    n, k = cfg.num_tests_per_prompt, cfg.k_value
    if cfg.metric == "pass@k":
        return eval_pass_k(rewards, n, k, cfg.pass_threshold)
    votes = [voting_answer(a) for a in answers]
    return eval_cons_k(rewards, n, k, votes, seed=cfg.seed, threshold=cfg.pass_threshold)


def sample_rows(samples: list[dict], num_tests_per_prompt: int) -> list[dict]:
    """The per-sample lines of samples.jsonl."""
    return [
        {
            "prompt_index": i // num_tests_per_prompt,
            "sample_index": i % num_tests_per_prompt,
            "idx": s["idx"],
            "task_name": s["task_name"],
            "prompt": s["prompt"],
            "response": s["response"],
            "reward": s["reward"],
            "extracted_answer": s["answer"],
            "ground_truth": s["ground_truth"],
            "truncated": s["truncated"],
            "strict_grade": s.get("strict_grade"),
        }
        for i, s in enumerate(samples)
    ]


def build_summary(
    cfg: EvalConfig, result: ValidationResult, score: float, elapsed_s: float
) -> dict[str, Any]:
    settings, gen = cfg.eval, cfg.generation
    return {
        "model": describe_model(cfg.model),
        "dataset": str(cfg.data.dataset),
        "metric": settings.metric.replace("k", str(settings.k_value)),
        "score": score,
        "k": settings.k_value,
        "num_tests_per_prompt": settings.num_tests_per_prompt,
        "records": settings.records,
        "num_prompts": len(result.samples) // settings.num_tests_per_prompt,
        "num_samples": len(result.samples),
        "accuracy": result.metrics["accuracy"],
        "grader": settings.grader,
        "strict_accuracy": result.metrics.get("strict_accuracy"),
        "num_strict_graded": int(result.metrics.get("num_strict_graded", 0)),
        "greedy": settings.greedy,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "max_new_tokens": gen.max_new_tokens,
        "backend": gen.backend,
        "seed": settings.seed,
        "mean_generated_length": result.metrics["mean_generated_length"],
        "truncation_rate": result.metrics["truncation_rate"],
        "elapsed_s": elapsed_s,
    }


def sampling_text(summary: dict[str, Any]) -> str:
    if summary["greedy"]:
        return f"greedy, max_new_tokens={summary['max_new_tokens']}"
    return (
        f"temperature={summary['temperature']}, top_p={summary['top_p']}, top_k={summary['top_k']}, "
        f"max_new_tokens={summary['max_new_tokens']}, seed={summary['seed']}"
    )


def summary_table(summary: dict[str, Any]) -> Table:
    """One row per field (fits a narrow terminal): model, dataset, metric, k, n, sampling, score."""
    table = Table(title="posttrain eval", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = {
        "model": summary["model"],
        "dataset": summary["dataset"],
        "metric": summary["metric"],
        "k": str(summary["k"]),
        "n (samples per prompt)": str(summary["num_tests_per_prompt"]),
        "prompts": str(summary["num_prompts"]),
        "sampling": sampling_text(summary),
        "backend": summary["backend"],
        "accuracy (mean reward)": f"{summary['accuracy']:.4f}",
        f"strict accuracy ({summary['grader']})": (
            "-"
            if summary["strict_accuracy"] is None
            else f"{summary['strict_accuracy']:.4f} of {summary['num_strict_graded']} graded"
        ),
        "score": f"[bold]{summary['score']:.4f}[/bold]",
    }
    for name, value in rows.items():
        table.add_row(name, value)
    return table


def write_outputs(save_path: Path, summary: dict[str, Any], rows: list[dict]) -> None:
    (save_path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(save_path / "samples.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row, default=str) + "\n" for row in rows)


@dataclass
class EvalResult:
    """What `run_eval` produced (also written under `save_path`)."""

    summary: dict[str, Any]
    samples: list[dict]  # the lines of samples.jsonl
    save_path: Path


def prepare_save_path(cfg: EvalConfig) -> Path:
    """The output directory (`eval.save_path`, default results/eval-<time>), created, with the config
    (that directory filled in) saved there; `cfg` itself is left as validated."""
    save_path = Path(cfg.eval.save_path or f"results/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    save_path.mkdir(parents=True, exist_ok=True)
    save_config(
        dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, save_path=str(save_path))),
        save_path / "config.yaml",
    )
    return save_path


def run_eval(cfg: EvalConfig) -> EvalResult:
    """Evaluate `cfg.model` on the validation records of `cfg.data`; write summary.json and samples.jsonl."""
    check_model_source(cfg.model)
    save_path = prepare_save_path(cfg)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        scratch_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".model-", dir=save_path)))
        model_dir = materialize_model(cfg.model, scratch_dir)
        tokenizer_name = cfg.model.tokenizer_name or model_dir
        tokenizer = load_tokenizer(tokenizer_name)
        records = load_eval_records(cfg, tokenizer, processor_for(model_dir, cfg.model.tokenizer_name))
        cluster = RayVirtualCluster(cfg.cluster)
        stack.callback(cluster.shutdown)
        generation = make_generation(
            cluster if cfg.generation.colocated else None, cfg.generation, str(model_dir), str(tokenizer_name)
        )
        stack.callback(generation.shutdown)
        envs = create_environments(cfg.env)
        for env in envs.values():
            stack.callback(env.shutdown)
        result = roll_out(cfg.eval, generation, records, tokenizer, envs)
    rows = sample_rows(result.samples, cfg.eval.num_tests_per_prompt)
    score = compute_score(cfg.eval, result.rewards.tolist(), [row["extracted_answer"] for row in rows])
    summary = build_summary(cfg, result, score, time.perf_counter() - start)
    write_outputs(save_path, summary, rows)
    log_results(cfg, summary, result, save_path)
    Console().print(summary_table(summary))
    return EvalResult(summary, rows, save_path)


def eval_step(model_name: str | None) -> int:
    """The step an evaluation is logged at: N for a run's checkpoint directory `.../step_N` (so it lands
    beside that run's training curves), else 0."""
    match = re.fullmatch(r"step_(\d+)", Path(model_name or "").name)
    return int(match.group(1)) if match else 0


def log_results(cfg: EvalConfig, summary: dict[str, Any], result: ValidationResult, save_path: Path) -> None:
    """The summary's numbers as metrics `eval/<name>` at `eval_step` and the config as hyperparameters,
    through the unified logger (JSONL, TensorBoard, W&B, MLflow as `logger` enables; `save_path` unless
    `logger.log_dir` names another directory); samples as in validation."""
    step = eval_step(cfg.model.model_name)
    logger_cfg = cfg.logger if cfg.logger.log_dir else dataclasses.replace(cfg.logger, log_dir=str(save_path))
    with Logger(logger_cfg) as logger:
        logger.log_hyperparams(
            {"eval": cfg.eval, "model": cfg.model, "generation": cfg.generation, "data": cfg.data}
        )
        numbers = {
            k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        logger.log_metrics(numbers, step=step, prefix="eval")
        logger.log_val_samples(result.samples, step=step)


def main(args: Any) -> int:
    cfg = load_run_config(EvalConfig, args)
    result = run_eval(cfg)
    print(f"eval {result.summary['metric']} = {result.summary['score']:.4f}; results in {result.save_path}")
    return 0
