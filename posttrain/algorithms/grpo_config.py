"""The configuration of `posttrain grpo` (and `ppo`, `distill`): the loop's knobs, DAPO's options, and the
checks that span sections, run when the config loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.algorithms.advantages import ESTIMATORS
from posttrain.algorithms.checks import check_loop_lengths, check_parallelism, missing_model_files
from posttrain.algorithms.critic import CriticConfig
from posttrain.algorithms.grpo_async import AsyncGRPOConfig
from posttrain.algorithms.health import HealthConfig
from posttrain.algorithms.loss import ClippedPGLossConfig
from posttrain.algorithms.run import TrainingConfig
from posttrain.algorithms.teacher import TeacherConfig
from posttrain.config import ConfigError, closest
from posttrain.environments import EnvironmentConfig
from posttrain.environments.registry import (
    default_task_name,
    environment_file_problems,
    match_task_to_environments,
)
from posttrain.environments.tool_env import ToolEnvironmentConfig
from posttrain.evals.graders import grader_problems
from posttrain.evals.validate import SamplingSettings
from posttrain.workers.generation import GenerationConfig
from posttrain.workers.policy import PolicyConfig
from posttrain.workers.policy.config import policy_with_lr

# TRL's GRPO default, for a pretrained model. On SmolLM2-135M at 8 questions x 8 samples a step, 5e-5
# collapsed held-out accuracy (63% -> 24% in 15 steps) and 2e-5 with four updates a step lost 4 points
# (benchmarks/reference/time_to_accuracy_smollm2_cpu.json); the tiny recipes set their own, larger rate.
GRPO_LR = 1e-6


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more to fill the step."""

    enabled: bool = False
    """drop zero-signal groups"""
    max_num_gen_batches: int = 4
    """most generation rounds per step"""


@dataclass
class OverlongShapingConfig:
    """DAPO soft overlong punishment added to the reward of long responses."""

    enabled: bool = False
    """penalise responses near max_new_tokens"""
    buffer_length: int = 16
    """tokens before the limit where the penalty ramps up"""
    penalty_factor: float = 1.0
    """penalty at the limit"""


@dataclass
class RewardScalingConfig:
    """Affine reward shaping: reward * scale + shift."""

    enabled: bool = False
    """apply scale and shift"""
    scale: float = 1.0
    """multiplier"""
    shift: float = 0.0
    """offset"""


@dataclass
class GRPOLoopConfig:
    """The GRPO loop's own knobs."""

    RENAMED: ClassVar[dict[str, str]] = {
        "val_num_generations": "validation.num_tests_per_prompt",
        "val_pass_k": "validation.k_value",
        "val_greedy": "validation.greedy",
        "val_pass_threshold": "validation.pass_threshold",
        "val_grader": "validation.grader",
    }

    num_prompts_per_step: int = 32
    """prompts per step"""
    num_generations_per_prompt: int = 8
    """samples per prompt (the group)"""
    max_num_steps: int = 100
    """training steps"""
    max_rollout_turns: int = 1
    """turns per episode (1: single-turn)"""
    max_seq_len: int = 256
    """most tokens of a conversation; longer is truncated"""
    advantage_estimator: str = "grpo"
    """an entry of `advantages.ESTIMATORS`. grpo: group baseline (with normalize_rewards,
    use_leave_one_out_baseline); dr_grpo: R - group mean, no std (needs loss.constant_length_normalizer);
    reinforce_pp: rewards whitened over the batch's tokens (REINFORCE++); reinforce_pp_baseline: R - group
    mean, then whitened over the batch's tokens; gae: PPO, per-token GAE from the value model of the critic
    section; on_policy_distillation: log pi_teacher - log pi_student per token (teacher section);
    rejection_sampling: SFT's loss on the replies with reward >= rejection_sampling_min_reward"""
    rejection_sampling_min_reward: float = 1.0
    """advantage_estimator rejection_sampling: the least reward kept"""
    normalize_rewards: bool = True
    """divide advantages by the group std (advantage_estimator grpo; with use_leave_one_out_baseline too
    it is the whole group's std, where NeMo RL divides by each sample's leave-one-out std)"""
    use_leave_one_out_baseline: bool = False
    """RLOO baseline instead of the mean (advantage_estimator grpo)"""
    overlong_filtering: bool = False
    """DAPO: no loss on truncated samples"""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO"""
    overlong_shaping: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    """DAPO"""
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    """shaping"""
    val_period: int = 10
    """validate every this many steps (0: never)"""
    val_at_start: bool = True
    """validate before the first step"""
    max_val_samples: int = 256
    """validation prompts used"""
    validation: SamplingSettings = field(default_factory=SamplingSettings)
    """how validation prompts are sampled and graded (the keys of `posttrain eval`'s section)"""
    val_max_reward_gap: float = 0.1
    """warn when val reward exceeds the strict grade by more than this"""
    early_stop_val_accuracy: float | None = None
    """stop when val accuracy >= this"""
    seed: int = 42
    """seed of the rollout sampling"""
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    """asynchronous GRPO"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """learning-health signals and their warnings"""

    def validate(self) -> None:
        check_loop_lengths(self)
        if self.advantage_estimator not in ESTIMATORS:
            raise ConfigError(
                "advantage_estimator",
                f"unknown estimator {self.advantage_estimator!r}, not one of {', '.join(ESTIMATORS)}",
                suggestion=closest(self.advantage_estimator, list(ESTIMATORS)),
            )
        if self.use_leave_one_out_baseline and self.advantage_estimator != "grpo":
            raise ConfigError(
                "use_leave_one_out_baseline",
                f"is an option of advantage_estimator 'grpo', not {self.advantage_estimator!r}",
            )


@dataclass
class GRPOConfig(TrainingConfig):
    """`posttrain grpo` configuration."""

    grpo: GRPOLoopConfig = field(default_factory=GRPOLoopConfig)
    """the GRPO loop"""
    loss: ClippedPGLossConfig = field(default_factory=ClippedPGLossConfig)
    """policy loss"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(GRPO_LR))
    """the trained model (AdamW lr 1e-6 by default)"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model (grpo.advantage_estimator gae)"""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """the frozen teacher (grpo.advantage_estimator on_policy_distillation)"""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """rollout sampling"""
    env: dict[str, EnvironmentConfig] = field(default_factory=lambda: {"arithmetic": EnvironmentConfig()})
    """task name -> environment"""

    def __post_init__(self) -> None:
        default_task_name(self.data, self.env)

    def validate(self) -> None:
        check_parallelism(self.policy, self.cluster)
        if self.grpo.advantage_estimator == "dr_grpo" and self.loss.constant_length_normalizer is None:
            raise ConfigError(
                "loss.constant_length_normalizer",
                "grpo.advantage_estimator 'dr_grpo' divides the loss by a constant length: set it, e.g. to "
                f"generation.max_new_tokens ({self.generation.max_new_tokens})",
            )
        batch = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if batch % self.policy.train_global_batch_size:
            raise ConfigError(
                "policy.train_global_batch_size",
                f"{self.policy.train_global_batch_size} must divide the "
                f"{batch} samples of a step (grpo.num_prompts_per_step x grpo.num_generations_per_prompt): "
                f"one of {[d for d in range(1, batch + 1) if batch % d == 0][-4:]}, or change those two",
            )
        self.validate_async()
        match_task_to_environments(self.data, self.env)
        check_tool_environments(self.env, self.grpo.max_rollout_turns)
        helper = ESTIMATORS[self.grpo.advantage_estimator].helper
        if helper == "teacher" and self.teacher.model.model_name is None:
            raise ConfigError(
                "teacher.model.model_name",
                "on-policy distillation needs a teacher: a model directory or hub name",
            )
        if self.teacher.top_k and (
            self.policy.backend != "dtensor" or self.teacher.model.backend != "dtensor"
        ):
            raise ConfigError(
                "teacher.top_k",
                "distillation on the teacher's top-k runs on the dtensor backend (policy and teacher)",
            )
        if helper == "critic":
            check_parallelism(self.critic.model, self.cluster)
            if batch % self.critic.model.train_global_batch_size:
                raise ConfigError(
                    "critic.model.train_global_batch_size",
                    f"{self.critic.model.train_global_batch_size} must divide the {batch} samples of a step",
                )
        if self.policy.moe.router_replay and self.generation.backend == "vllm":
            raise ConfigError(
                "policy.moe.router_replay",
                "the generator's experts are recorded by the hf generation backend only: set "
                "generation.backend=hf or policy.moe.router_replay=false",
            )
        max_rank, lora = self.generation.vllm_lora_max_rank, self.policy.lora
        if lora.enabled and max_rank is not None and lora.rank > max_rank:
            raise ConfigError(
                "generation.vllm_lora_max_rank",
                f"{max_rank} is below policy.lora.rank={lora.rank}: vLLM could not load the adapter",
            )

    def validate_async(self) -> None:
        """Async GRPO generates on workers of its own and, with stale data, needs the IS correction."""
        async_cfg = self.grpo.async_grpo
        if async_cfg.enabled and self.generation.colocated:
            raise ConfigError(
                "grpo.async_grpo.enabled",
                "asynchronous GRPO generates while the policy trains, so the generation workers need bundles "
                "of their own: set generation.colocated=false (and generation.num_workers)",
            )
        if async_cfg.enabled and async_cfg.lend_idle_cores and self.generation.backend == "vllm":
            raise ConfigError(
                "grpo.async_grpo.lend_idle_cores",
                "lends threads to the hf generation backend only (vLLM sets its own): set "
                "generation.backend=hf or lend_idle_cores=false",
            )
        if async_cfg.partial_rollouts and not async_cfg.enabled:
            raise ConfigError(
                "grpo.async_grpo.partial_rollouts",
                "refits between chunks while the policy trains: set grpo.async_grpo.enabled=true",
            )
        if async_cfg.partial_rollouts and self.generation.backend == "vllm":
            raise ConfigError(
                "grpo.async_grpo.partial_rollouts",
                "chunks the hf generation backend only: set generation.backend=hf",
            )
        if (
            async_cfg.enabled
            and async_cfg.max_trajectory_age_steps > 0
            and not self.loss.use_importance_sampling_correction
        ):
            raise ConfigError(
                "loss.use_importance_sampling_correction",
                f"grpo.async_grpo trains on trajectories up to {async_cfg.max_trajectory_age_steps} step(s) "
                "old: set it to true (and loss.truncated_importance_sampling_ratio, e.g. 2.0) so that the "
                "loss weights them by pi_prev / pi_generation, or set "
                "grpo.async_grpo.max_trajectory_age_steps=0",
            )

    def missing_files(self) -> list[ConfigError]:
        """Missing data files, model directories (the critic's and teacher's too, where the estimator uses
        them), reward and environment files and grader files, one error each (run before anything starts)."""
        helper = ESTIMATORS[self.grpo.advantage_estimator].helper
        models = {"critic": self.critic.model, "teacher": self.teacher.model}
        return (
            super().missing_files()
            + (missing_model_files(f"{helper}.model", models[helper]) if helper in models else [])
            + environment_file_problems(self.env)
            + grader_problems("grpo.validation.grader", self.grpo.validation.grader)
        )


def check_tool_environments(env_cfgs: dict[str, EnvironmentConfig], max_rollout_turns: int) -> None:
    """The keyword arguments of every `tools` environment, checked when the config loads; a tool episode
    needs a second turn to answer after its call."""
    for task, env_cfg in env_cfgs.items():
        if env_cfg.cls == "tools" and max_rollout_turns < 2:
            raise ConfigError(
                "grpo.max_rollout_turns",
                f"env.{task} is a tools environment: set >= 2 (a call, then the answer)",
            )
        if env_cfg.cls == "tools":
            try:
                ToolEnvironmentConfig.from_kwargs(env_cfg.kwargs)
            except (KeyError, TypeError, ValueError) as error:
                raise ConfigError(f"env.{task}.kwargs", str(error).strip("'\"")) from None
