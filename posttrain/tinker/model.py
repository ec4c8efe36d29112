"""One tenant's trained model for the Tinker-compatible service: a base model (LoRA adapters or all weights
trainable), gradients that accumulate over forward_backward calls until an Adam step applies them, the
Tinker losses as free functions, and states saved through posttrain's CheckpointManager."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from posttrain.models.build import load_model
from posttrain.models.lora import LoraConfig, adapter_weights, wrap_with_lora
from posttrain.utils.checkpoint import CheckpointingConfig, CheckpointManager

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}


class UserError(ValueError):
    """A request the client got wrong (the SDK shows it as a user error)."""


@dataclasses.dataclass
class Datum:
    """One sequence: its input token ids and the loss inputs named by the loss (each [T])."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def token_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> torch.Tensor:
    """Per-token loss [T] of `loss_fn` from the model's `logprobs` [T] of the target tokens; the loss of a
    datum is its sum. cross_entropy: -w * logp. importance_sampling: -(p / q) * A, q the sampler's
    probability. ppo: -min(r * A, clip(r, 1 - low, 1 + high) * A) with r = p / q. cispo:
    -sg(clip(r)) * A * logp."""
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * logprobs
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = ratio.clamp(
        1 - config.get("clip_low_threshold", 0.2), 1 + config.get("clip_high_threshold", 0.2)
    )
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages)
    return -clipped.detach() * advantages * logprobs  # cispo


def check_datum(datum: Datum, loss_fn: str | None, max_tokens: int) -> None:
    """Raise UserError for a datum the loss cannot use: too long, a missing input, a length that differs."""
    if not datum.tokens or len(datum.tokens) > max_tokens:
        raise UserError(f"a datum has {len(datum.tokens)} tokens; this server takes 1 to {max_tokens}")
    needed = LOSS_INPUTS[loss_fn] if loss_fn else ("target_tokens",)
    for name in needed:
        if name not in datum.inputs:
            raise UserError(f"loss {loss_fn!r} needs loss_fn_inputs[{name!r}], given {sorted(datum.inputs)}")
        if (got := datum.inputs[name].numel()) != len(datum.tokens):
            raise UserError(f"loss_fn_inputs[{name!r}] has {got} values for {len(datum.tokens)} tokens")


def state_manager(directory: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(directory), metric_name=None))


def latest_state(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The latest intact state saved under `directory` (its manifest verified) and its info."""
    manager = state_manager(directory)
    path = manager.get_latest_intact_checkpoint_path()
    if path is None:
        raise UserError(f"no intact saved state at {directory.name}")
    return path, manager.load_training_info(path) or {}


class TrainedModel:
    """A model of one tenant: `lora_rank` None trains all weights; one AdamW over its trainable weights."""

    def __init__(self, base_model: str, lora_rank: int | None, lora_alpha: float, seed: int) -> None:
        torch.manual_seed(seed)  # the adapters' initialisation
        model = load_model(base_model)
        self.lora = LoraConfig(enabled=True, rank=lora_rank or 1, alpha=lora_alpha)
        if lora_rank is not None:
            model = wrap_with_lora(model, self.lora, base_model=base_model)
        self.model, self.lora_rank, self.num_steps = model, lora_rank, 0
        self.vocab_size = model.config.vocab_size
        self.params = [param for param in model.parameters() if param.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0)

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict, backward: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Each datum's target logprobs and per-token loss; with `backward`, the summed loss's gradients are
        added to those of earlier calls (they stay until optim_step)."""
        lengths = [len(datum.tokens) for datum in data]
        input_ids = torch.zeros(len(data), max(lengths), dtype=torch.long)  # [B, T]
        mask = torch.zeros_like(input_ids)
        targets = torch.zeros_like(input_ids)
        for row, datum in enumerate(data):
            input_ids[row, : lengths[row]] = torch.tensor(datum.tokens)
            mask[row, : lengths[row]] = 1
            targets[row, : lengths[row]] = datum.inputs["target_tokens"].long()
        if min(input_ids.min(), targets.min()) < 0 or max(input_ids.max(), targets.max()) >= self.vocab_size:
            raise UserError(f"a token id is outside the model's vocabulary of {self.vocab_size}")
        self.model.train(backward)
        with torch.set_grad_enabled(backward):
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()  # [B, T, V]
            all_logprobs = (
                torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            )  # [B, T]
            outputs, total = [], torch.zeros(())
            for row, datum in enumerate(data):
                logprobs = all_logprobs[row, : lengths[row]]
                losses = token_loss(loss_fn, logprobs, datum.inputs, config)
                total = total + losses.sum()
                outputs.append({"logprobs": logprobs.detach(), "elementwise_loss": losses.detach()})
        if backward:
            total.backward()
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step with the request's parameters on the accumulated gradients, which it then clears."""
        for group in self.optimizer.param_groups:
            group["lr"] = adam.get("learning_rate", 1e-4)
            group["betas"] = (adam.get("beta1", 0.9), adam.get("beta2", 0.95))
            group["eps"] = adam.get("eps", 1e-12)
            group["weight_decay"] = adam.get("weight_decay", 0.0)
        metrics = {}
        if adam.get("grad_clip_norm", 0.0) > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, adam["grad_clip_norm"])
            metrics["grad_norm"] = float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.num_steps += 1
        return metrics

    def sampler_weights(self) -> Any:
        """The refit payload a generation worker loads: the adapters (LoRA) or all weights."""
        state = self.trainable_state()
        if self.lora_rank is None:
            return state
        return adapter_weights(self.model, state, self.lora, "causal_lm")

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def save_state(self, directory: Path) -> None:
        """Write the trainable weights and the optimizer as a finalized checkpoint under `directory`."""
        manager = state_manager(directory)
        path = manager.init_tmp_checkpoint(
            self.num_steps, {"step": self.num_steps, "lora_rank": self.lora_rank}
        )
        torch.save(self.trainable_state(), path / "weights.pt")
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        manager.finalize_checkpoint(path)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        """Load the latest state under `directory`: the weights, and the Adam state `with_optimizer`."""
        path, info = latest_state(directory)
        if info.get("lora_rank") != self.lora_rank:
            raise UserError(f"the state has lora_rank {info.get('lora_rank')}, this model {self.lora_rank}")
        weights = torch.load(path / "weights.pt", weights_only=True)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    param.copy_(weights[name])
        if with_optimizer:
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.num_steps = int(info.get("step", 0))
