"""Where each GRPO step's batch comes from. `RolloutSource` is the interface the GRPO loop calls;
`SyncRollouts` generates each step's batch with the current weights, `grpo_async.AsyncRollouts` takes it
from generation running ahead. Both collect through a `RolloutCollector`: prompts x generations ->
rollouts with shaped `rewards`, with DAPO dynamic sampling. None of these needs a run object; given a
generation backend and environments that run in this process, none needs Ray."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.algorithms import advantages as adv
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.experience.agent_rollouts import run_rollout
from posttrain.experience.rollouts import generated_lengths, records_to_rollout_batch
from posttrain.experience.trajectory_buffer import TrajectoryBatch
from posttrain.utils.timer import Timer
from posttrain.workers.refit import Refit


class RolloutSource(Protocol):
    """The GRPO loop's supply of batches. `step` is the number of optimizer steps taken so far."""

    def next_batch(self, step: int, timer: Timer) -> tuple[TrajectoryBatch, dict[str, float]]:
        """The batch that trains step `step + 1`, and the source's own metrics (logged under `async/`)."""

    def after_update(self, step: int) -> None:
        """The policy has trained on the batch of step `step + 1`: its new weights are for generation."""

    def hold_for_validation(self) -> None:
        """A validation follows the next update: generate nothing new in between (the next
        `validation_phase` releases the hold)."""

    def validation_phase(self, step: int, timer: Timer) -> AbstractContextManager[None]:
        """Entered around validation: the generation workers are the loop's, with the weights of `step`."""

    def generation_weights(self) -> Any:
        """All the weights the generation workers hold now (an ObjectRef), for a worker that replaces a
        lost one mid-generate; called on the thread that generates."""

    def loader_state(self) -> dict[str, Any]:
        """The data-loader position a checkpoint saves: just after the last batch trained on."""

    def accounting(self) -> dict[str, int]:
        """Counters a checkpoint saves and `restore` reads back."""

    def restore(self, training_info: dict[str, Any]) -> None:
        """Take back the counters of a checkpoint's training info."""

    def shutdown(self) -> None:
        """Stop whatever runs in the background."""


def select_groups(batch: BatchedDataDict, keep_rows: torch.Tensor) -> BatchedDataDict:
    return batch.select_indices(torch.nonzero(keep_rows).flatten().tolist())


def shaped_rewards(cfg: Any, rollouts: BatchedDataDict, max_new_tokens: int) -> torch.Tensor:
    """Environment rewards with the configured DAPO shaping (`grpo.overlong_shaping`, `grpo.reward_scaling`)
    applied. [N]"""
    rewards = rollouts["total_reward"].float()
    if cfg.overlong_shaping.enabled:
        shaping = cfg.overlong_shaping
        lengths = generated_lengths(rollouts["message_log"])
        rewards = rewards + adv.overlong_reward_penalty(
            lengths, max_new_tokens, shaping.buffer_length, shaping.penalty_factor
        )
    if cfg.reward_scaling.enabled:
        rewards = adv.scale_rewards(rewards, cfg.reward_scaling.scale, cfg.reward_scaling.shift)
    return rewards


@dataclass
class RolloutCollector:
    """Generates and scores one step's groups: the `grpo` config section, a generation backend
    (`RayGeneration`), the training prompts' loader, the tokenizer and one environment per task."""

    cfg: Any  # GRPOLoopConfig
    generation: Any
    loader: Any  # StatefulDataLoader of num_prompts_per_step records per batch
    tokenizer: Any
    envs: dict[str, Any]
    max_new_tokens: int

    def collect(self, step: int, timer: Timer | None = None) -> tuple[BatchedDataDict, dict[str, float]]:
        """Prompts x generations -> rollouts with `rewards` for training step `step` (its sampling seeds
        derive from it). With DAPO dynamic sampling, groups whose rewards are all equal are set aside and
        more rounds are generated (up to the limit) until the step is full; a step still short after the
        last round is filled with set-aside groups (their advantages are 0). The environments' share of
        the time is recorded in `timer` as "rewards"."""
        cfg, n = self.cfg, self.cfg.num_generations_per_prompt
        target = cfg.num_prompts_per_step * n
        rounds = cfg.dynamic_sampling.max_num_gen_batches if cfg.dynamic_sampling.enabled else 1
        kept, set_aside, metrics = [], [], {}
        for round_index in range(rounds):
            batch = records_to_rollout_batch(self.loader.next_batch(), n)
            seed = cfg.seed * 1_000_003 + step * 1_000 + round_index * 100
            limits = (cfg.max_seq_len, cfg.max_rollout_turns)
            rollouts, metrics_round = run_rollout(
                self.generation, batch, self.tokenizer, self.envs, *limits, seed=seed, timer=timer
            )
            rollouts["rewards"] = shaped_rewards(cfg, rollouts, self.max_new_tokens)
            metrics = metrics or metrics_round  # the first round describes the policy's samples
            if cfg.dynamic_sampling.enabled:
                signal = adv.groups_with_signal(rollouts["rewards"], n).repeat_interleave(n)
                kept.append(select_groups(rollouts, signal))
                set_aside.append(select_groups(rollouts, ~signal))
            else:
                kept.append(rollouts)
            if sum(r.size for r in kept) >= target:
                break
        num_with_signal = sum(r.size for r in kept)
        rollouts = BatchedDataDict.from_batches(kept + set_aside).slice(0, target)
        metrics["num_generation_rounds"] = float(round_index + 1)
        if cfg.dynamic_sampling.enabled:
            metrics["dynamic_sampling/samples_with_signal"] = float(min(num_with_signal, target))
            metrics["dynamic_sampling/filled_without_signal"] = float(max(0, target - num_with_signal))
        return rollouts, metrics


class SyncRollouts:
    """Each step generates its own batch with the current weights (colocated or not): the generation
    phase refits stale weights first."""

    def __init__(self, collector: RolloutCollector, refit: Refit) -> None:
        self.collector, self.refit = collector, refit

    def next_batch(self, step: int, timer: Timer) -> tuple[TrajectoryBatch, dict[str, float]]:
        with self.refit.generation_phase(timer), timer.time("generation"):
            rollouts, metrics = self.collector.collect(step + 1, timer)  # "rewards" timed inside
        return TrajectoryBatch(rollouts, metrics, step + 1, step), {}

    def after_update(self, step: int) -> None:
        self.refit.mark_stale()  # the next generation phase refits

    def hold_for_validation(self) -> None:
        """Nothing to hold: generation runs only when the loop asks for a batch."""

    def validation_phase(self, step: int, timer: Timer) -> AbstractContextManager[None]:
        return self.refit.generation_phase(timer)

    def generation_weights(self) -> Any:
        """The policy's current weights: the generation phase refitted the workers to them, and the policy
        does not train while they generate."""
        return self.refit.publish_all()

    def loader_state(self) -> dict[str, Any]:
        return self.collector.loader.state_dict()

    def accounting(self) -> dict[str, int]:
        return {}

    def restore(self, training_info: dict[str, Any]) -> None:
        pass

    def shutdown(self) -> None:
        pass
