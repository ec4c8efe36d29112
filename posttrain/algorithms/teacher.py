"""On-policy distillation's teacher on GRPO's loop (`grpo.advantage_estimator: on_policy_distillation`):
a frozen causal LM on a worker group of its own that scores the student's sampled tokens.

Algorithm as implemented (GKD, Agarwal et al. 2024, arXiv:2306.13649, with the reverse KL as in Qwen3's
on-policy distillation): the student (the policy) samples responses as in GRPO; the teacher computes
log pi_teacher of each sampled token; each token's advantage is log pi_teacher - log pi_student (the
student's sampling logprobs), plus `teacher.reward_weight` times the environment's group-relative
advantage; the student takes GRPO's clipped policy-gradient step on it. With `teacher.top_k` = k > 0 the
student instead minimises, at every position of its own samples, the forward KL from the teacher's
renormalised top-k next tokens (`loss.KDLoss`: GKD's on-policy distillation, a supervised loss on
on-policy data, no advantage). The teacher must share the
student's tokenizer (checked at setup, an error names `teacher.model.model_name` otherwise). Departures:
per-token credit only (discount 0), and the teacher is any Hugging Face causal LM (it may be larger).

Run: posttrain distill --config configs/distill_tiny.yaml"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.algorithms.checks import check_model_exists
from posttrain.config import ConfigError
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import RayVirtualCluster
from posttrain.models.build import load_tokenizer
from posttrain.models.tokenizer import tokenizer_mismatch
from posttrain.workers.policy import Policy, PolicyConfig


@dataclass
class TeacherConfig:
    """On-policy distillation's frozen teacher (used with grpo.advantage_estimator on_policy_distillation)."""

    model: PolicyConfig = field(default_factory=PolicyConfig)
    """the teacher: a causal LM with the student's tokenizer (only its forward runs)"""
    reward_weight: float = 0.0
    """weight of the environment's group-relative advantage added to the distillation advantage; 0 = pure
    distillation"""

    top_k: int = 0
    """0: each sampled token's advantage is log pi_teacher - log pi_student (a policy gradient); k > 0: the
    loss on the student's samples is the forward KL from the teacher's top-k next tokens at every sampled
    position (GKD's supervised on-policy distillation)"""
    whiten_advantages: bool = True
    """whiten the distillation advantages over the batch's trained tokens (the batch mean is a baseline:
    nearly every sampled token starts below the teacher's logprob)"""

    def validate(self) -> None:
        if self.model.model_kind != "causal_lm":
            raise ConfigError(
                "model.model_kind", f"the teacher is a causal_lm, got {self.model.model_kind!r}"
            )
        if self.reward_weight < 0:
            raise ConfigError("reward_weight", f"{self.reward_weight} must be >= 0")
        if self.top_k < 0:
            raise ConfigError("top_k", f"{self.top_k} must be >= 0")
        if self.top_k and self.reward_weight:
            raise ConfigError("reward_weight", "a reward needs the policy gradient: use it with top_k 0")


def check_same_tokenizer(student_tokenizer: Any, model: PolicyConfig, key: str = "teacher.model") -> None:
    """ConfigError naming `<key>.model_name` unless the teacher `model` exists and its tokenizer gives the
    student's ids (on-policy distillation's `teacher.model`, SFT's `distillation.teacher`)."""
    check_model_exists(f"{key}.model_name", model.model_name)
    if model.tokenizer_name:
        check_model_exists(f"{key}.tokenizer_name", model.tokenizer_name)
    teacher_tokenizer = load_tokenizer(model.tokenizer_name or model.model_name)
    mismatch = tokenizer_mismatch(student_tokenizer, teacher_tokenizer)
    if mismatch is not None:
        raise ConfigError(
            f"{key}.model_name",
            f"{model.model_name} does not share the student's tokenizer ({mismatch}): the teacher "
            "scores the student's token ids, so both need the same vocabulary",
        )


def topk_targets(teacher: Policy, train_data: BatchedDataDict, k: int) -> dict[str, torch.Tensor]:
    """`teacher_topk_logprobs` and `teacher_topk_ids` [B, T, k] at every position of the batch (on-policy
    distillation's teacher, SFT's `distillation.teacher`)."""
    targets = teacher.get_topk_logprobs(train_data, k)
    return {"teacher_topk_logprobs": targets["topk_logprobs"], "teacher_topk_ids": targets["topk_ids"]}


class Teacher:
    """The teacher's worker group; `logprobs` is its one stage (`topk_targets(teacher.model, ...)` with
    `teacher.top_k`)."""

    def __init__(self, cluster: RayVirtualCluster, cfg: TeacherConfig, policy: Policy, share: float) -> None:
        self.cfg = cfg
        host = policy.host_for(cfg.model)
        self.model = Policy(cluster, cfg.model, name_prefix="teacher", bundle_share=share, host=host)

    def logprobs(self, train_data: BatchedDataDict) -> torch.Tensor:
        """log pi_teacher of each token of the batch [B, T] (position 0 and padding 0)."""
        return self.model.get_logprobs(train_data)["logprobs"]

    def shutdown(self) -> None:
        self.model.shutdown()
