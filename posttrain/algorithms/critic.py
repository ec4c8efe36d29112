"""PPO's critic on GRPO's loop (`grpo.advantage_estimator: gae`): a value model beside the policy, the
values and returns it gives GAE, and its clipped value-loss update.

Algorithm as implemented (PPO, Schulman et al. 2017, arXiv:1707.06347, with GAE, arXiv:1506.02438): the
critic is the policy's architecture with a linear value head on every position (`critic.model.model_kind:
value_model`, started from the policy's weights unless `critic.model.model_name` names others; a new head
starts at zero, so the first advantages are the rewards). Each step it computes V_t for the batch's trained
(assistant) tokens, the sequence reward sits on the last of them, GAE with `critic.gamma` and `critic.lam`
gives A_t and the returns R_t = A_t + V_t, and A_t is whitened over the batch's trained tokens (A_t is the
`gae` entry of `advantages.ESTIMATORS`, R_t this module's). The policy then takes its clipped
policy-gradient step on A_t, and the critic one step of the clipped value loss toward R_t. Departures from
the paper: no per-token KL penalty in the reward (the KL penalty, if any, is the loss's), and one epoch
over each batch, as in GRPO's loop.

Run: posttrain ppo --config configs/ppo_tiny.yaml"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from posttrain.algorithms import advantages as adv
from posttrain.algorithms.checks import check_model_exists
from posttrain.algorithms.loss import ValueLoss, ValueLossConfig
from posttrain.config import ConfigError
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import RayVirtualCluster
from posttrain.utils.metrics import mean_over_steps
from posttrain.workers.policy import Policy, PolicyConfig


@dataclass
class CriticConfig:
    """PPO's critic: a value model trained beside the policy (used with grpo.advantage_estimator gae)."""

    model: PolicyConfig = field(default_factory=lambda: PolicyConfig(model_kind="value_model"))
    """the value model (model_kind value_model); model_name null = the policy's model, with a new value
    head"""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """value loss"""
    gamma: float = 1.0
    """GAE discount per token"""
    lam: float = 0.95
    """GAE lambda: 0 = one-step TD, 1 = Monte Carlo"""
    whiten_advantages: bool = True
    """whiten the advantages over the batch's trained tokens"""

    def validate(self) -> None:
        if self.model.model_kind != "value_model":
            raise ConfigError(
                "model.model_kind", f"the critic is a value_model, got {self.model.model_kind!r}"
            )
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(key, f"{getattr(self, key)} must be in [0, 1]")


class Critic:
    """The value model's worker group and its two stages: `estimate` (values and returns) and `train`."""

    def __init__(
        self, cluster: RayVirtualCluster, cfg: CriticConfig, policy: Policy, bundle_share: float
    ) -> None:
        self.cfg = cfg
        if cfg.model.model_name:
            check_model_exists("critic.model.model_name", cfg.model.model_name)
        model_cfg = dataclasses.replace(cfg.model, model_name=cfg.model.model_name or policy.cfg.model_name)
        host = policy.host_for(model_cfg)
        self.model = Policy(cluster, model_cfg, name_prefix="critic", bundle_share=bundle_share, host=host)

    def estimate(
        self, train_data: BatchedDataDict, rewards: torch.Tensor, token_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """What the critic adds to a batch for its sequence rewards [B] on the trained tokens token_mask
        [B, T], each [B, T]: `returns` R_t = A_t + V_t (GAE's A_t) that the value loss aims at, and the
        values that computed them, `prev_values` (the value clip's centre, the `gae` estimator's input)."""
        values = self.model.get_values(train_data)["values"] * token_mask  # [B, T]
        token_rewards = adv.terminal_token_rewards(rewards, token_mask)  # [B, T]
        gae = adv.gae_advantages(token_rewards, values, token_mask, self.cfg.gamma, self.cfg.lam)
        return {"returns": gae.returns, "prev_values": values}

    def train(self, train_data: BatchedDataDict) -> dict[str, float]:
        """One value-loss step per global batch of the critic; train_data holds returns and prev_values."""
        return mean_over_steps(self.model.train(train_data, ValueLoss(self.cfg.loss)))

    def shutdown(self) -> None:
        self.model.shutdown()
