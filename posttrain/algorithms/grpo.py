"""Group Relative Policy Optimization (GRPO) with verifiable rewards, and its DAPO/GSPO variants.

Algorithm as implemented: each step takes `num_prompts_per_step` prompts, samples
`num_generations_per_prompt` responses per prompt (single- or multi-turn, scored by each task's
environment), computes group-relative advantages (mean or leave-one-out baseline, optionally divided by
the group's std where it is non-zero), and takes one optimizer step per global batch of the clipped
policy-gradient loss against the logprobs of the policy that generated the data (`prev_logprobs`:
recomputed by the trainer before the first step, or, when the whole batch is one step, the trained
forward's own logprobs with the gradient stopped), optionally with a KL penalty to the frozen initial
policy. The new weights reach the generation workers (refit) when they next generate; colocated on an
accelerator, the policy's training state leaves the device while they do (`Refit.generation_phase`).
Departures from the paper: KL is off by default (beta = 0, as in DAPO); DAPO's dynamic sampling,
clip-higher, overlong shaping/filtering and GSPO's sequence-level ratios are options of the config.
Every step also logs its learning-health signals and warns when learning stalls, the entropy collapses,
the replies run away or the reward falls (`health.py`, `grpo.health`).

Other advantage estimators run on the same loop (`grpo.advantage_estimator`, each described in
`grpo_config.GRPOLoopConfig`; `advantages.ESTIMATORS` gives each its formula, the helper model it reads and
its loss): `dr_grpo`, `reinforce_pp`, `reinforce_pp_baseline`, `gae` (PPO: `critic.py`),
`on_policy_distillation` (`teacher.py`) and `rejection_sampling` (expert iteration: SFT's `NLLLoss` on the
replies whose reward reaches `grpo.rejection_sampling_min_reward`, the others masked out; the next step
samples from the updated policy).

Asynchronous GRPO (`grpo.async_grpo.enabled`) takes each step's batch from generation running ahead
(`grpo_async.py` explains it); the loss corrects for the stale generator (`loss.py`).

Run: posttrain grpo --config configs/grpo_tiny.yaml
     posttrain grpo --config configs/grpo_dr_tiny.yaml          (Dr. GRPO)
     posttrain grpo --config configs/reinforce_pp_tiny.yaml     (REINFORCE++-baseline)
     posttrain ppo --config configs/ppo_tiny.yaml               (PPO with a value model)
     posttrain distill --config configs/distill_tiny.yaml       (on-policy distillation)
     posttrain grpo --config configs/rft_lists_smollm2.yaml     (rejection-sampling fine-tuning)
     posttrain grpo --config configs/grpo_tiny.yaml grpo.async_grpo.enabled=true generation.colocated=false
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithms import advantages as adv
from posttrain.algorithms import health
from posttrain.algorithms.checks import check_batch_fits
from posttrain.algorithms.critic import Critic
from posttrain.algorithms.grpo_async import AsyncRollouts
from posttrain.algorithms.grpo_config import GRPOConfig, GRPOLoopConfig
from posttrain.algorithms.grpo_rollouts import RolloutCollector, RolloutSource, SyncRollouts
from posttrain.algorithms.loss import ClippedPGLoss, KDLoss, NLLLoss
from posttrain.algorithms.recovery import train_with_restarts
from posttrain.algorithms.run import (
    check_run_directories,
    checkpoint_if_due,
    log_step,
    prepare_run,
    restore_run,
    shutdown_on_error,
)
from posttrain.algorithms.teacher import Teacher, check_same_tokenizer, topk_targets
from posttrain.config import ConfigError, load_run_config
from posttrain.data import StatefulDataLoader, load_datasets, message_log_to_flat
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.core_lease import lend_cores
from posttrain.distributed.placement import ResourceRequest
from posttrain.distributed.shared_weights import shared_memory_supported
from posttrain.distributed.virtual_cluster import RayVirtualCluster
from posttrain.environments import EnvironmentPool, create_environments, tool_prompts
from posttrain.environments.registry import check_record_tasks
from posttrain.evals.graders import reward_hacking_warning
from posttrain.evals.validate import run_validation
from posttrain.models.build import load_tokenizer
from posttrain.models.vlm import processor_for
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.logger import Logger
from posttrain.utils.metrics import mean_over_steps
from posttrain.utils.progress import StepProgress
from posttrain.utils.timer import Timer
from posttrain.workers.generation import RayGeneration, make_generation
from posttrain.workers.policy import Policy
from posttrain.workers.refit import Refit, shared_memory_kind

log = logging.getLogger(__name__)


@dataclass
class GRPORun:
    """The parts of one GRPO run and its position; `grpo_train` advances `step`. Refit state lives in
    `refit`, the supply of batches (synchronous or asynchronous) in `rollouts`."""

    cfg: GRPOConfig
    log_dir: Path
    tokenizer: Any
    policy: Policy
    generation: RayGeneration
    clusters: list[RayVirtualCluster]
    envs: dict[str, EnvironmentPool]
    val_records: list[dict]
    logger: Logger
    checkpoints: CheckpointManager
    refit: Refit
    rollouts: RolloutSource
    step: int = 0
    last_val: dict[str, float] = field(default_factory=dict)
    critic: Critic | None = None  # PPO's value model (grpo.advantage_estimator gae)
    teacher: Teacher | None = None  # on-policy distillation's teacher
    health_monitor: health.HealthMonitor | None = None  # learning-health warnings (grpo.health)

    def models(self) -> dict[str, Policy]:
        """The models a checkpoint holds, by directory name: the policy and PPO's critic."""
        return {"policy": self.policy, **({"critic": self.critic.model} if self.critic is not None else {})}

    def shutdown(self) -> None:
        if self.critic is not None:
            self.critic.shutdown()
        if self.teacher is not None:
            self.teacher.shutdown()
        self.rollouts.shutdown()
        self.logger.finish()
        for env in self.envs.values():
            env.shutdown()
        self.generation.shutdown()
        self.policy.shutdown()
        for cluster in self.clusters:
            cluster.shutdown()


def make_refit(cfg: GRPOConfig, policy: Policy, generation: RayGeneration, stale: bool) -> Refit:
    """The refit between `policy` and `generation` as the config places them."""
    colocated = cfg.generation.colocated
    shared_memory = shared_memory_kind(
        colocated,
        cfg.policy.lora.enabled,
        generation.backend_name,
        cfg.cluster.num_nodes,
        cfg.cluster.num_nodes * cfg.cluster.workers_per_node,
        cfg.cluster.num_gpus_per_worker,
        shared_memory_supported(),
    )
    return Refit(
        policy,
        generation,
        cfg.generation.precision,
        shared_memory,
        move_memory=colocated and cfg.cluster.num_gpus_per_worker > 0,
        colocated_offload=cfg.generation.colocated_offload,
        stale=stale,
    )


def placed_beside_policy(cfg: GRPOConfig) -> list[ResourceRequest]:
    """What GRPO places outside the policy's bundles: each environment's actors and, apart from the
    policy, the generation workers' bundles (on one node)."""
    requests = [
        ResourceRequest(f"env.{task}.num_workers x num_cpus", {"CPU": env.num_cpus}, env.num_workers)
        for task, env in cfg.env.items()
    ]
    if not cfg.generation.colocated:
        gen = cfg.generation
        requests.append(
            ResourceRequest(
                "generation.num_workers x num_cpus_per_worker",
                {"CPU": gen.num_cpus_per_worker, "GPU": 1.0 if cfg.cluster.num_gpus_per_worker else 0.0},
                gen.num_workers,
                one_node=True,
            )
        )
    return requests


def make_rollout_source(
    cfg: GRPOConfig, collector: RolloutCollector, refit: Refit, policy: Policy, generation: Any, step: int
) -> RolloutSource:
    """Where each step's batch comes from: generated by the loop itself, or by the asynchronous producer
    (with a core lease between trainer and generator when `lend_idle_cores`)."""
    async_cfg = cfg.grpo.async_grpo
    if not async_cfg.enabled:
        return SyncRollouts(collector, refit)
    lease = None
    if async_cfg.lend_idle_cores:
        lease = lend_cores(policy.worker_group, generation.worker_group, generation.backend_name)
    chunk = async_cfg.partial_rollout_chunk_tokens if async_cfg.partial_rollouts else None
    return AsyncRollouts(
        collector, refit, async_cfg.max_trajectory_age_steps, step, cfg.grpo.max_num_steps, lease, chunk
    )


def setup(cfg: GRPOConfig) -> GRPORun:
    """Data, policy, generation workers, environments, logger, checkpoints; resumes when it can."""
    cfg = prepare_run(cfg, "grpo", metric=("val_accuracy", True))
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    processor = processor_for(cfg.policy.model_name, cfg.policy.tokenizer_name)  # None unless vision-language
    train_records, val_records, data_stats = load_datasets(
        cfg.data, tokenizer, processor, tool_prompts(cfg.env)
    )
    check_record_tasks(train_records + val_records, cfg.env, cfg.data)
    prompts = cfg.grpo.num_prompts_per_step
    check_batch_fits(len(train_records), prompts, "grpo.num_prompts_per_step", prompts, cfg.data.dataset)
    loader = StatefulDataLoader(
        train_records, prompts, shuffle=cfg.data.shuffle, seed=cfg.data.training_order_seed
    )
    cluster = RayVirtualCluster(cfg.cluster, also_needs=placed_beside_policy(cfg))
    with shutdown_on_error(cluster):  # a failed start leaves no placement group or worker behind
        check_run_directories(cfg, cluster.bundle_node_ids())
        # A PPO critic or a teacher takes a quarter of each bundle, as the policy then does, beside
        # generation's half.
        helper = adv.ESTIMATORS[cfg.grpo.advantage_estimator].helper
        if helper == "teacher":
            check_same_tokenizer(tokenizer, cfg.teacher.model)
        share = 0.5 if helper == "none" else 0.25
        policy = Policy(
            cluster,
            cfg.policy,
            init_reference_model=keeps_reference(cfg),
            bundle_share=share,
        )
        critic = Critic(cluster, cfg.critic, policy, share) if helper == "critic" else None
        teacher = Teacher(cluster, cfg.teacher, policy, share) if helper == "teacher" else None
        generation = make_generation(
            cluster if cfg.generation.colocated else None,
            cfg.generation,
            cfg.policy.model_name,
            max_worker_restarts=cfg.cluster.max_restarts,
            host=policy.worker_group,
        )
        envs = create_environments(cfg.env)
        checkpoints = CheckpointManager(cfg.checkpointing)
        models = {"policy": policy, **({"critic": critic.model} if critic is not None else {})}
        restored = restore_run(checkpoints, models, loader)
        step = int(restored["step"]) if restored is not None else 0
        refit = make_refit(cfg, policy, generation, stale=restored is not None)
        collector = RolloutCollector(
            cfg.grpo, generation, loader, tokenizer, envs, cfg.generation.max_new_tokens
        )
        rollouts = make_rollout_source(cfg, collector, refit, policy, generation, step)
        if restored is not None:
            rollouts.restore(restored)
        generation.set_weights_source(rollouts.generation_weights)  # for a worker lost mid-generate
        logger = Logger(cfg.logger)
        logger.log_hyperparams(
            {"grpo": cfg.grpo, "loss": cfg.loss, "policy": cfg.policy, "generation": cfg.generation}
        )
        logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, step)
        return GRPORun(
            cfg,
            Path(cfg.logger.log_dir),
            tokenizer,
            policy,
            generation,
            [cluster],
            envs,
            val_records[: cfg.grpo.max_val_samples],
            logger,
            checkpoints,
            refit,
            rollouts,
            step,
            critic=critic,
            teacher=teacher,
            health_monitor=health.HealthMonitor(cfg.grpo.health) if cfg.grpo.health.enabled else None,
        )


def flat_routed_experts(logs: list[list[dict]], num_cols: int) -> torch.Tensor | None:
    """The experts an MoE generator routed each generated token to, aligned with input_ids: [B, T, L, k]
    int16, -1 where nothing was recorded (prompts, observations, padding); None without any recording."""
    recorded = [m["routed_experts"] for log in logs for m in log if "routed_experts" in m]
    if not recorded:
        return None
    routed = torch.full((len(logs), num_cols, *recorded[0].shape[1:]), -1, dtype=torch.int16)
    for i, log in enumerate(logs):
        start = 0
        for m in log:
            if "routed_experts" in m:
                routed[i, start : start + len(m["token_ids"])] = m["routed_experts"]
            start += len(m["token_ids"])
    return routed


def build_train_data(
    rollouts: BatchedDataDict, pad_token_id: int, overlong_filtering: bool
) -> BatchedDataDict:
    """input_ids, input_lengths, token_mask (generated tokens), sample_mask and generation_logprobs [B,T]
    aligned with input_ids, and an MoE generator's routed_experts [B, T, L, k]."""
    logs = rollouts["message_log"]
    train_data = message_log_to_flat(logs, pad_token_id, train_on="sampled")
    generation_logprobs = torch.zeros(train_data["input_ids"].shape, dtype=torch.float32)
    for i, log in enumerate(logs):
        per_token = [
            torch.as_tensor(m["generation_logprobs"], dtype=torch.float32)
            if "generation_logprobs" in m
            else torch.zeros(len(m["token_ids"]))
            for m in log
        ]
        flat = torch.cat(per_token)
        generation_logprobs[i, : len(flat)] = flat
    train_data["generation_logprobs"] = generation_logprobs
    routed_experts = flat_routed_experts(logs, train_data["input_ids"].shape[1])
    if routed_experts is not None:
        train_data["routed_experts"] = routed_experts
    sample_mask = torch.ones(len(logs))
    if overlong_filtering:
        sample_mask = adv.overlong_filter_mask(rollouts["truncated"])
    if "failed" in rollouts:  # an agent's failed episode trains nothing (its reward is its group's mean)
        sample_mask = sample_mask * (~rollouts["failed"]).float()
    train_data["sample_mask"] = sample_mask
    return train_data


def trained_token_mask(train_data: BatchedDataDict) -> torch.Tensor:
    """token_mask * sample_mask: the tokens the loss trains on [B, T]."""
    return train_data["token_mask"].float() * train_data["sample_mask"].float().unsqueeze(1)


def estimator_inputs(cfg: GRPOConfig, **tensors: torch.Tensor) -> adv.EstimatorInputs:
    """The advantage estimators' knobs from the config, with the helper model's `tensors` (values,
    teacher_logprobs, student_logprobs: `adv.EstimatorInputs`)."""
    loop = cfg.grpo
    return adv.EstimatorInputs(
        loop.num_generations_per_prompt,
        "leave_one_out" if loop.use_leave_one_out_baseline else "mean",
        loop.normalize_rewards,
        loop.rejection_sampling_min_reward,
        cfg.critic.gamma,
        cfg.critic.lam,
        cfg.critic.whiten_advantages,
        cfg.teacher.whiten_advantages,
        cfg.teacher.reward_weight,
        **tensors,
    )


def validate(run: GRPORun, step: int, timer: Timer | None = None) -> dict[str, float]:
    cfg = run.cfg.grpo
    with run.rollouts.validation_phase(run.step, timer or Timer()):
        result = run_validation(
            run.generation,
            run.val_records,
            run.tokenizer,
            run.envs,
            cfg.max_seq_len,
            cfg.max_rollout_turns,
            settings=cfg.validation,
            seed=cfg.seed,
        )
    warning = reward_hacking_warning(result.metrics, result.samples, cfg.val_max_reward_gap)
    if warning:
        log.warning("step %d: %s", step, warning)
    run.logger.log_metrics(result.metrics, step, prefix="val")
    run.logger.log_val_samples(result.samples, step)
    run.last_val = result.metrics
    return result.metrics


def checkpoint(run: GRPORun, force: bool = False) -> None:
    """The run's state when due: the step, the last validation metrics (`val_accuracy` ranks checkpoints)
    and the rollout source's counters."""
    info = {"step": run.step, **{f"val_{k}": v for k, v in run.last_val.items()}, **run.rollouts.accounting()}
    loader_state = run.rollouts.loader_state()
    checkpoint_if_due(run.checkpoints, run.models(), run.step, info, loader_state, run.cfg, force)


def add_advantages(
    run: GRPORun, train_data: BatchedDataDict, rewards: torch.Tensor, token_mask: torch.Tensor, timer: Timer
) -> dict[str, float]:
    """The advantages stage: the helper model's tensors (the critic's values, with the returns its value
    loss aims at; the teacher's logprobs, or its top-k targets instead of advantages), then the estimator's
    per-token advantages [B, T] of the rewards [B], into train_data. Returns metrics."""
    name = run.cfg.grpo.advantage_estimator
    estimator, metrics = adv.ESTIMATORS[name], {}
    tensors = {"student_logprobs": train_data["generation_logprobs"]}  # [B, T], the sampling policy's
    if run.critic is not None:
        with timer.time("values"):
            train_data.update(run.critic.estimate(train_data, rewards, token_mask))
        tensors["values"] = train_data["prev_values"]  # [B, T]
    if run.teacher is not None and run.teacher.cfg.top_k:  # supervised: the teacher's top-k as targets
        with timer.time("teacher_topk"):
            train_data.update(topk_targets(run.teacher.model, train_data, run.teacher.cfg.top_k))
        train_data["advantages"] = torch.zeros_like(token_mask)
        return metrics
    if run.teacher is not None:
        with timer.time("teacher_logprobs"):
            tensors["teacher_logprobs"] = run.teacher.logprobs(train_data)  # [B, T]
        log_ratio = (tensors["student_logprobs"] - tensors["teacher_logprobs"]) * token_mask
        metrics["distillation/reverse_kl"] = float(log_ratio.sum() / token_mask.sum().clamp(min=1.0))
    inputs = estimator_inputs(run.cfg, **tensors)
    with timer.time("advantages"):
        train_data["advantages"] = estimator.fn(rewards, token_mask, inputs)
    if estimator.keep is not None:
        kept = estimator.keep(rewards, inputs)  # [B]
        train_data["sample_mask"] = train_data["sample_mask"] * kept  # the others train nothing
        metrics[f"{name}/accepted_share"] = float(kept.mean())
    return metrics


def grpo_step(run: GRPORun, timer: Timer) -> dict[str, float]:
    """One GRPO step, stage by stage (docs/architecture.md shows its data flow)."""
    cfg = run.cfg.grpo
    batch, async_metrics = run.rollouts.next_batch(run.step, timer)
    rollouts, rollout_metrics = batch.rollouts, batch.metrics
    train_data = build_train_data(rollouts, run.tokenizer.pad_token_id, cfg.overlong_filtering)
    token_mask = trained_token_mask(train_data)  # [B, T]
    advantage_metrics = add_advantages(run, train_data, rollouts["rewards"], token_mask, timer)
    # One optimizer step over the whole batch: pi_prev is the policy as it trains (the loss stops the
    # gradient of its own logprobs). Several steps: pi_prev must be recorded before the first. This holds
    # for stale (async) data too: pi_prev is the current weights, and the distance to the weights that
    # generated the data is the loss's importance weight against generation_logprobs.
    single_update = train_data.size == run.cfg.policy.train_global_batch_size
    supervised = "teacher_topk_ids" in train_data  # on-policy distillation on the teacher's top-k
    nll = adv.ESTIMATORS[cfg.advantage_estimator].loss == "nll"  # SFT's loss (rejection sampling)
    if not (single_update or supervised or nll):
        with timer.time("logprobs"):
            train_data["prev_logprobs"] = run.policy.get_logprobs(train_data)["logprobs"]
    kl_measured = reference_due(run.cfg, run.step + 1)
    if kl_measured:
        with timer.time("reference_logprobs"):
            reference = run.policy.get_reference_policy_logprobs(train_data)
            train_data["reference_policy_logprobs"] = reference["reference_policy_logprobs"]
    with timer.time("training"):
        loss_fn = ClippedPGLoss(run.cfg.loss, prev_is_current=single_update)
        loss_fn = KDLoss() if supervised else NLLLoss() if nll else loss_fn
        metrics = mean_over_steps(run.policy.train(train_data, loss_fn))
    computed = metrics.get("num_computed_tokens", 0.0)  # positions the training forwards computed
    metrics["padding_share"] = 1.0 - metrics.get("num_real_tokens", 0.0) / computed if computed else 0.0
    if run.critic is not None:
        with timer.time("critic_training"):
            metrics.update({f"critic/{k}": v for k, v in run.critic.train(train_data).items()})
    run.rollouts.after_update(run.step)  # sync: refit at the next generation; async: publish the weights
    metrics.update(advantage_metrics)
    metrics.update({f"rollout/{k}": v for k, v in rollout_metrics.items()})
    metrics.update({f"async/{k}": v for k, v in async_metrics.items()})
    metrics["refit_bytes"] = float(run.refit.take_bytes_sent())
    metrics["reward_mean"] = float(rollouts["total_reward"].mean())
    metrics["advantage_abs_mean"] = float(
        (train_data["advantages"].abs() * token_mask).sum() / token_mask.sum().clamp(min=1.0)
    )
    if run.health_monitor is not None:
        signals = health.step_signals(
            rollouts["rewards"], cfg.num_generations_per_prompt, metrics, rollout_metrics, kl_measured
        )
        health.report(run.health_monitor, run.step + 1, signals)
        metrics.update({f"health/{k}": v for k, v in signals.items()})
    return metrics


def keeps_reference(cfg: GRPOConfig) -> bool:
    """The policy keeps a frozen copy of its starting weights: for the KL penalty, or to log the KL to
    them (`grpo.health.kl_to_start_period`)."""
    return cfg.loss.reference_policy_kl_penalty > 0 or (
        cfg.grpo.health.enabled and cfg.grpo.health.kl_to_start_period > 0
    )


def reference_due(cfg: GRPOConfig, step: int) -> bool:
    """Step `step` computes the starting weights' logprobs: on every step for the KL penalty, every
    `grpo.health.kl_to_start_period` steps (and the first) for the health signal alone."""
    if cfg.loss.reference_policy_kl_penalty > 0:
        return True
    period = cfg.grpo.health.kl_to_start_period if cfg.grpo.health.enabled else 0
    return period > 0 and (step == 1 or step % period == 0)


def validation_due(cfg: GRPOLoopConfig, step: int, last_step: int) -> bool:
    """Validate after step `step`: every `val_period` steps and after the last."""
    return bool(cfg.val_period) and (step % cfg.val_period == 0 or step == last_step)


def grpo_train(run: GRPORun, num_steps: int | None = None) -> dict[str, float]:
    """Train to `grpo.max_num_steps` (or `num_steps` more); returns the last validation metrics."""
    cfg = run.cfg.grpo
    last_step = cfg.max_num_steps if num_steps is None else min(cfg.max_num_steps, run.step + num_steps)
    timer = Timer()
    if cfg.val_at_start and run.step == 0 and cfg.val_period:
        validate(run, 0)
    with StepProgress("grpo", last_step, start=run.step) as progress:
        while run.step < last_step:
            start = time.perf_counter()
            validation_next = validation_due(cfg, run.step + 1, last_step)
            if validation_next:
                run.rollouts.hold_for_validation()
            metrics = grpo_step(run, timer)
            run.step += 1
            metrics["step_time"] = time.perf_counter() - start
            log_step(run.logger, run.policy, metrics, timer, run.step)
            if validation_next:
                validate(run, run.step, timer)
            checkpoint(run, force=run.step == last_step)
            progress.advance(
                run.step,
                {
                    "reward": metrics["reward_mean"],
                    **{f"val_{k}": v for k, v in run.last_val.items() if k == "accuracy"},
                },
            )
            if (
                cfg.early_stop_val_accuracy is not None
                and run.last_val.get("accuracy", -1.0) >= cfg.early_stop_val_accuracy
            ):
                print(f"early stop at step {run.step}: val accuracy {run.last_val['accuracy']:.3f}")
                break
    return run.last_val


def train_to_end(run: GRPORun) -> dict[str, float]:
    """Train to the last step and export the policy to <log_dir>/hf_model; the last validation metrics."""
    val = grpo_train(run)
    run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val


# `posttrain ppo` and `posttrain distill` run this loop and insist on their estimator, so that their config
# cannot silently run without its critic or teacher: command -> (estimator, what the command does).
COMMAND_ESTIMATORS = {
    "ppo": ("gae", "trains a critic and needs"),
    "distill": ("on_policy_distillation", "scores the student's samples with a teacher and needs"),
}


def main(args: Any) -> int:
    """`posttrain grpo`, `posttrain ppo` (critic.py) and `posttrain distill` (teacher.py)."""
    cfg = load_run_config(GRPOConfig, args)
    estimator, does = COMMAND_ESTIMATORS.get(getattr(args, "command", "grpo"), (None, ""))
    if estimator is not None and cfg.grpo.advantage_estimator != estimator:
        raise ConfigError(
            "grpo.advantage_estimator",
            f"posttrain {args.command} {does} {estimator!r}, got {cfg.grpo.advantage_estimator!r} "
            "(or run posttrain grpo)",
        )
    run, val = train_with_restarts(cfg, setup, train_to_end)  # rebuilds the workers when some die
    print(
        f"grpo finished at step {run.step}: val accuracy {val.get('accuracy', float('nan')):.3f}; run "
        f"directory {run.log_dir}"
    )
    return 0
