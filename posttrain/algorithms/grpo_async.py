"""Asynchronous GRPO's config and rollout source: the GRPO loop takes each step's batch from an
`AsyncRolloutProducer` (experience/async_rollouts.py) that generates the coming steps on the generation
workers while the policy trains, instead of generating it itself (`grpo_rollouts.SyncRollouts`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from posttrain.config import ConfigError
from posttrain.experience.async_rollouts import AsyncRolloutProducer
from posttrain.experience.partial_rollouts import ChunkedGeneration, token_versions
from posttrain.experience.trajectory_buffer import TrajectoryBatch, trajectory_age
from posttrain.utils.timer import Timer
from posttrain.workers.refit import Refit


@dataclass
class AsyncGRPOConfig:
    """Asynchronous GRPO: generate the next steps' rollouts while the policy trains (needs
    generation.colocated=false)."""

    enabled: bool = False
    """overlap generation of the next steps with training (separate workers)"""
    max_trajectory_age_steps: int = 1
    """most optimizer steps between the weights that generated a trajectory and the weights trained on it
    (0: on-policy, equals the synchronous loop)"""

    lend_idle_cores: bool = False
    """trainer and generator on one machine: the side that waits lends its CPU threads to the other (the
    trainer's micro-batches take the generator's threads once its batch is done; validation takes the
    trainer's); faster, but thread counts then follow timing, so runs are not bitwise reproducible. hf
    generation backend only"""

    partial_rollouts: bool = False
    """generate each batch in chunks of partial_rollout_chunk_tokens and refit newer weights between
    chunks: replies still running continue from their prefix with the new weights (the prefix is prefilled
    again) instead of finishing with the old ones; each token records its weight version. hf generation
    backend only"""
    partial_rollout_chunk_tokens: int = 16
    """most new tokens per chunk of a partial rollout (>= 1)"""

    def validate(self) -> None:
        if self.partial_rollout_chunk_tokens < 1:
            raise ConfigError(
                "partial_rollout_chunk_tokens", f"must be >= 1, got {self.partial_rollout_chunk_tokens}"
            )
        if self.max_trajectory_age_steps < 0:
            raise ConfigError(
                "max_trajectory_age_steps", f"must be >= 0, got {self.max_trajectory_age_steps}"
            )


class AsyncRollouts:
    """Batches from an `AsyncRolloutProducer` thread that generates ahead on the generation workers
    (a `grpo_rollouts.RolloutSource`).

    The trainer publishes every version's full weights (ObjectRefs) for the producer. A checkpoint saves
    the loader position after the last batch trained on; on resume the batches that were in flight are
    generated again from there (same prompts and seeds), with the restored weights.

    `partial_chunk_tokens` (partial rollouts): the collector generates through a `ChunkedGeneration` that
    refits the newest published weights between chunks; the batch's per-token versions are
    `generation_weight_versions` [B, T] (-1 off the generated tokens), and the logged ages are per token.
    Which weights made a token no longer follows from the step alone, so such runs are not reproducible
    bit for bit."""

    def __init__(
        self,
        collector: Any,
        refit: Refit,
        max_age: int,
        step: int,
        last_step: int,
        lease: Callable[[str | None], Any] | None = None,
        partial_chunk_tokens: int | None = None,
    ) -> None:
        self.refit = refit
        loader = collector.loader
        self.consumed_loader_state = loader.state_dict()
        self.num_trained = self.num_dropped = 0
        generation = collector.generation
        self.chunked = None
        if partial_chunk_tokens is not None:
            self.chunked = ChunkedGeneration(
                generation,
                partial_chunk_tokens,
                collector.max_new_tokens,
                int(collector.tokenizer.pad_token_id),
                between_chunks=lambda: self.producer.refit_newest(),
            )
            collector = dataclasses.replace(collector, generation=self.chunked)
        self.collector = collector
        self.producer = AsyncRolloutProducer(
            produce=self.collect,
            refit=generation.update_weights,
            loader_state=loader.state_dict,
            max_age=max_age,
            first_index=step + 1,
            last_index=last_step,
            start_version=step,
            generation_version=None if refit.stale else step,
            lease=lease,
            start_newest=self.chunked is not None,
        )
        self.hold = False  # pause the producer with the next weights (a validation follows)
        self.publish_weights(step)

    def collect(self, index: int) -> tuple[Any, dict[str, float]]:
        """The rollouts of step `index` (on the producer thread), with the chunk counts of partial ones."""
        rollouts, metrics = self.collector.collect(index)
        if self.chunked is not None:
            metrics.update(self.chunked.take_counts())
        return rollouts, metrics

    def next_batch(self, step: int, timer: Timer) -> tuple[TrajectoryBatch, dict[str, float]]:
        with timer.time("rollout_wait"):
            taken, generator_wait_s = self.producer.take(step)
        batch = taken.batch
        self.consumed_loader_state = batch.loader_state
        self.num_trained += batch.num_trajectories
        self.num_dropped += taken.num_dropped
        age_mean = age_max = float(trajectory_age(step, batch.policy_version))  # one version per batch
        if self.chunked is not None:
            versions = token_versions(batch.rollouts["message_log"])  # [B, T]
            batch.rollouts["generation_weight_versions"] = versions
            ages = (step - versions)[versions >= 0].float()  # per generated token
            if ages.numel():
                age_mean, age_max = float(ages.mean()), float(ages.max())
        return batch, {
            "trajectory_age_mean": age_mean,
            "trajectory_age_max": age_max,
            "dropped_stale_trajectories": float(taken.num_dropped),
            "buffer_trajectories": float(taken.num_buffered),
            "trainer_wait_s": taken.wait_s,
            "generator_wait_s": generator_wait_s,
            "generation_s": batch.metrics.pop("generation_s", 0.0),
            "trained_trajectories_total": float(self.num_trained),
            "dropped_trajectories_total": float(self.num_dropped),
        }

    def after_update(self, step: int) -> None:
        self.publish_weights(step + 1)

    def hold_for_validation(self) -> None:
        """Publish the next weights with the producer paused, so that the validation after the update need not
        wait for a batch begun in between (generated with one side's cores while the other waits)."""
        self.hold = True

    def publish_weights(self, version: int) -> None:
        """All of the policy's weights (any version may follow any other in the generation workers), in
        the generation dtype, as the synchronous refit sends them; fetched by every generation worker."""
        self.producer.publish(version, self.refit.publish_all(), pause=self.hold)
        self.hold = False

    def validation_phase(self, step: int, timer: Timer) -> AbstractContextManager[None]:
        return self.producer.paused_at(step)

    def generation_weights(self) -> Any:
        """The published weights of the version the generation workers hold (the one the batch in progress
        is generated with), not the trainer's newer ones."""
        return self.producer.generating_weights()

    def loader_state(self) -> dict[str, Any]:
        return self.consumed_loader_state

    def accounting(self) -> dict[str, int]:
        return {
            "async_trained_trajectories": self.num_trained,
            "async_dropped_trajectories": self.num_dropped,
        }

    def restore(self, training_info: dict[str, Any]) -> None:
        self.num_trained = int(training_info.get("async_trained_trajectories", 0))
        self.num_dropped = int(training_info.get("async_dropped_trajectories", 0))

    def shutdown(self) -> None:
        self.producer.stop()
