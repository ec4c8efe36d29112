"""Validation and evaluation share this: roll out prompts with a generation backend, score them with
their environments, and report accuracy, pass@k and lengths plus per-sample results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config import ConfigError
from posttrain.data.vision import content_text
from posttrain.evals.graders import resolve_grader, strict_grades
from posttrain.evals.metrics import eval_pass_k
from posttrain.experience.agent_rollouts import run_rollout
from posttrain.experience.rollouts import records_to_rollout_batch


@dataclass
class SamplingSettings:
    """How prompts are sampled and graded when a model is measured: one definition for `posttrain eval`
    (section `eval`) and for GRPO's validation during training (section `grpo.validation`)."""

    num_tests_per_prompt: int = 1
    """n: samples generated per prompt"""
    k_value: int = 1
    """k of pass@k / cons@k (>= 1, <= num_tests_per_prompt)"""
    greedy: bool = True
    """argmax decoding (needs num_tests_per_prompt 1); false: sample"""
    pass_threshold: float = 1.0
    """a sample counts as solved in pass@k / cons@k when its reward is >= this (1.0: partial credit is not
    a pass)"""
    grader: str | None = "final_number"
    """strict grade reported beside the reward ('final_number': the reply's last number equals a numeric
    ground truth; file.py:function or module:function; null: none)"""

    def validate(self) -> None:
        if self.k_value < 1:
            raise ConfigError("k_value", f"must be >= 1, got {self.k_value}")
        if self.num_tests_per_prompt < self.k_value:
            raise ConfigError(
                "num_tests_per_prompt", f"must be >= k_value={self.k_value}, got {self.num_tests_per_prompt}"
            )
        if self.greedy and self.num_tests_per_prompt > 1:
            raise ConfigError(
                "greedy",
                f"greedy decoding gives num_tests_per_prompt={self.num_tests_per_prompt} identical samples; "
                "set greedy=false to sample, or num_tests_per_prompt=1",
            )


@dataclass
class ValidationResult:
    metrics: dict[str, float]
    # prompt, response (every turn from the first sampled one), final_response (the last sampled turn),
    # message_log, reward, answer, ground truth
    samples: list[dict[str, Any]]
    rewards: torch.Tensor  # [num_prompts * num_generations], each prompt's samples contiguous


def sample_records(rollouts: Any) -> list[dict[str, Any]]:
    """Per-sample results of a finished rollout batch (JSON-friendly)."""
    samples = []
    for i, log in enumerate(rollouts["message_log"]):
        first_assistant = next((j for j, m in enumerate(log) if "generation_logprobs" in m), len(log))
        replies = [content_text(m["content"]) for m in log if "generation_logprobs" in m]  # sampled turns
        samples.append(
            {
                "idx": rollouts["idx"][i],
                "task_name": rollouts["task_name"][i],
                "prompt": "".join(content_text(m["content"]) for m in log[:first_assistant]),
                "response": "".join(content_text(m["content"]) for m in log[first_assistant:]),
                "final_response": replies[-1] if replies else "",
                "message_log": [{"role": m["role"], "content": m["content"]} for m in log],
                "reward": float(rollouts["total_reward"][i]),
                "answer": rollouts["answer"][i],
                "ground_truth": rollouts["extra_env_info"][i].get("ground_truth"),
                "truncated": bool(rollouts["truncated"][i]),
            }
        )
    return samples


def run_validation(
    generation: Any,
    records: list[dict],
    tokenizer: Any,
    task_to_env: dict,
    max_seq_len: int,
    max_rollout_turns: int = 1,
    settings: SamplingSettings | None = None,
    batch_size: int = 256,
    seed: int = 0,
) -> ValidationResult:
    """Roll out every record `settings.num_tests_per_prompt` times (in batches of `batch_size` prompts).

    `accuracy` is the mean reward (the fraction correct for 0/1 rewards); `pass@k` is the unbiased
    estimator over each prompt's samples, a sample passing when its reward is >= the pass threshold. With a
    grader, each sample also gets a `strict_grade` and the metrics `strict_accuracy` and `reward_gap`
    (`graders.strict_grades`)."""
    settings = settings or SamplingSettings()
    num_generations, greedy, k = settings.num_tests_per_prompt, settings.greedy, settings.k_value
    grader = resolve_grader(settings.grader)
    rewards, samples, lengths = [], [], []
    for start in range(0, len(records), batch_size):
        batch = records_to_rollout_batch(records[start : start + batch_size], num_generations)
        limits = (max_seq_len, max_rollout_turns)
        rollouts, metrics = run_rollout(
            generation, batch, tokenizer, task_to_env, *limits, greedy=greedy, seed=seed + start
        )
        rewards.append(rollouts["total_reward"])
        samples.extend(sample_records(rollouts))
        lengths.append(metrics["mean_generated_length"] * len(batch["message_log"]))
    all_rewards = torch.cat(rewards)
    metrics = {
        "accuracy": float(all_rewards.mean()),
        f"pass@{k}": eval_pass_k(all_rewards.tolist(), num_generations, k, settings.pass_threshold),
        "mean_generated_length": sum(lengths) / len(all_rewards),
        "truncation_rate": sum(s["truncated"] for s in samples) / len(samples),
        "num_samples": float(len(samples)),
    }
    if grader is not None:
        metrics.update(strict_grades(samples, grader))
    return ValidationResult(metrics, samples, all_rewards)
