"""Learning-health signals of an RL step, and the warnings they raise when learning has stopped.

Per step, from the batch the policy trained on and the loss's metrics:
- `health/zero_signal_share`: the share of groups whose rewards are all equal. Their group-relative
  advantages are 0, so they give no gradient; a step with share 1.0 did not learn anything.
- `health/entropy`: the mean negative log-probability of the sampled tokens under the policy (the
  loss's `approx_entropy`, an unbiased estimate of the per-token entropy of the sampling policy).
- `health/kl_to_start`: the mean per-token KL estimate between the policy and its starting weights,
  on the steps where the reference logprobs are computed (`health.kl_to_start_period`).
- `health/clip_fraction`: the share of trained tokens whose ratio left the clip range.
- `health/mean_reply_length` and `health/truncation_rate`: generated tokens per sample and the share of
  samples cut at the generation budget.

`HealthMonitor` warns, once per episode of a condition (again only after it cleared), naming the step and
the signal, when learning stalled, the entropy collapsed, the replies run away or the training reward fell
(each test, with its advice, is a `HealthMonitor` method; the thresholds are `HealthConfig`'s)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from posttrain.config import ConfigError

log = logging.getLogger(__name__)


@dataclass
class HealthConfig:
    """Thresholds of the learning-health warnings (`grpo.health`)."""

    enabled: bool = True
    """log the health/ signals and warn"""
    stall_zero_signal_share: float = 0.9
    """warn of a stall when at least this share of groups has all-equal rewards"""
    stall_steps: int = 3
    """... for this many steps in a row (the warning names the first)"""
    entropy_collapse_ratio: float = 0.1
    """warn when the entropy falls below this fraction of step 1's"""
    length_growth_ratio: float = 2.0
    """warn of runaway replies when their mean length exceeds this x step 1's"""
    runaway_truncation_rate: float = 0.5
    """... and at least this share of replies is cut at the budget"""
    reward_window: int = 5
    """steps averaged to compare the training reward now with at the start"""
    reward_drop_ratio: float = 0.4
    """warn when the recent mean reward falls below this fraction of the first one"""
    kl_to_start_period: int = 0
    """every this many steps, log health/kl_to_start (keeps a frozen copy of the starting weights; 0: only
    when loss.reference_policy_kl_penalty > 0, on every step)"""

    def validate(self) -> None:
        shares = ("stall_zero_signal_share", "entropy_collapse_ratio", "runaway_truncation_rate")
        for name in (*shares, "reward_drop_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(name, f"{getattr(self, name)} must be in [0, 1]")
        for name, least in (
            ("stall_steps", 1),
            ("reward_window", 1),
            ("length_growth_ratio", 1),
            ("kl_to_start_period", 0),
        ):
            if getattr(self, name) < least:
                raise ConfigError(name, f"{getattr(self, name)} must be >= {least}")


def zero_signal_share(rewards: torch.Tensor, num_generations: int) -> float:
    """Share of the groups (consecutive runs of `num_generations` rows of rewards [N]) whose rewards are
    all equal."""
    grouped = rewards.float().reshape(-1, num_generations)  # [G, n]
    return float((grouped.amax(dim=1) == grouped.amin(dim=1)).float().mean())


def step_signals(
    rewards: torch.Tensor,
    num_generations: int,
    train_metrics: dict[str, float],
    rollout_metrics: dict[str, float],
    kl_measured: bool,
) -> dict[str, float]:
    """The `health/` metrics of one step: rewards [N] of the trained batch, the loss's reduced metrics, the
    rollout metrics of the step's first generation round, and whether the loss saw reference logprobs
    (then its `kl_penalty` is the KL to the starting weights)."""
    signals = {
        "reward_mean": float(rewards.float().mean()),
        "zero_signal_share": zero_signal_share(rewards, num_generations),
        "entropy": train_metrics.get("approx_entropy", float("nan")),
        "clip_fraction": train_metrics.get("clip_fraction", float("nan")),
        "mean_reply_length": rollout_metrics.get("mean_generated_length", float("nan")),
        "truncation_rate": rollout_metrics.get("truncation_rate", float("nan")),
    }
    if kl_measured and "kl_penalty" in train_metrics:
        signals["kl_to_start"] = train_metrics["kl_penalty"]
    return signals


class HealthMonitor:
    """Watches the `health/` signals step by step and returns the warnings to print (each once per
    episode of its condition)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.first: dict[str, float] = {}
        self.stall_run = 0
        self.stall_start = 0
        self.active: set[str] = set()
        self.first_rewards: list[float] = []
        self.recent_rewards: deque[float] = deque(maxlen=cfg.reward_window)

    def observe(self, step: int, signals: dict[str, float]) -> list[str]:
        """The warnings newly raised at `step` by `signals` (a `step_signals` dict)."""
        for key in ("entropy", "mean_reply_length"):
            if key not in self.first and signals.get(key, float("nan")) > 0:
                self.first[key] = signals[key]
        conditions = {
            "stalled": self._stalled(step, signals),
            "entropy_collapsed": self._entropy_collapsed(signals),
            "length_runaway": self._length_runaway(signals),
            "reward_fell": self._reward_fell(signals),
        }
        warnings = []
        for name, message in conditions.items():
            if message is None:
                self.active.discard(name)
            elif name not in self.active:
                self.active.add(name)
                warnings.append(f"step {step}: {message}")
        return warnings

    def _stalled(self, step: int, signals: dict[str, float]) -> str | None:
        share = signals["zero_signal_share"]
        if share < self.cfg.stall_zero_signal_share:
            self.stall_run = 0
            return None
        if self.stall_run == 0:
            self.stall_start = step
        self.stall_run += 1
        if self.stall_run < self.cfg.stall_steps:
            return None
        return (
            f"learning has stalled: health/zero_signal_share >= {self.cfg.stall_zero_signal_share:g} "
            f"since step {self.stall_start} ({share:.0%} of groups now have all-equal rewards, so no "
            "gradient). All wrong: the task is too hard for the model (start from an SFT model, or easier "
            "prompts); all right: too easy. More samples per prompt or grpo.dynamic_sampling help in between"
        )

    def _entropy_collapsed(self, signals: dict[str, float]) -> str | None:
        first, entropy = self.first.get("entropy"), signals["entropy"]
        if first is None or not entropy < self.cfg.entropy_collapse_ratio * first:
            return None
        return (
            f"the policy's entropy collapsed: health/entropy {entropy:.4f} is below "
            f"{self.cfg.entropy_collapse_ratio:g} x step 1's {first:.4f}; the samples of a group become "
            "identical and stop giving a gradient (lower the learning rate, or raise "
            "loss.ratio_clip_max (clip-higher) or generation.temperature)"
        )

    def _length_runaway(self, signals: dict[str, float]) -> str | None:
        first, length = self.first.get("mean_reply_length"), signals["mean_reply_length"]
        if first is None or not length > self.cfg.length_growth_ratio * first:
            return None
        if not signals["truncation_rate"] >= self.cfg.runaway_truncation_rate:
            return None
        return (
            f"the replies run away: health/mean_reply_length {length:.1f} is over "
            f"{self.cfg.length_growth_ratio:g} x step 1's {first:.1f} and {signals['truncation_rate']:.0%} "
            "are cut at generation.max_new_tokens (check the samples for repetition; grpo.overlong_shaping "
            "or grpo.overlong_filtering penalise cut replies)"
        )

    def _reward_fell(self, signals: dict[str, float]) -> str | None:
        window = self.cfg.reward_window
        if len(self.first_rewards) < window:
            self.first_rewards.append(signals["reward_mean"])
        self.recent_rewards.append(signals["reward_mean"])
        if len(self.first_rewards) < window or len(self.recent_rewards) < window:
            return None
        first, recent = sum(self.first_rewards) / window, sum(self.recent_rewards) / window
        if not recent < self.cfg.reward_drop_ratio * first:
            return None
        return (
            f"the training reward fell: its mean over the last {window} steps, {recent:.3f}, is below "
            f"{self.cfg.reward_drop_ratio:g} x its mean over the first {window}, {first:.3f}; the policy is "
            "getting worse (lower the learning rate, or raise grpo.num_prompts_per_step)"
        )


def report(monitor: HealthMonitor, step: int, signals: dict[str, float]) -> None:
    """Log the warnings `signals` raise at `step`."""
    for warning in monitor.observe(step, signals):
        log.warning("%s", warning)
