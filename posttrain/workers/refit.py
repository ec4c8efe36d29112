"""Refit: how a policy's new weights reach the generation workers. On the worker side, `WeightVersions`
counts the changes of the weights so that a refit of unchanged weights sends nothing; on the driver side,
`Refit` decides the path (shared memory or the object store), when weights are stale, and what was sent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.utils.timer import Timer

log = logging.getLogger(__name__)


@dataclass
class WeightVersions:
    """A worker's weight version (optimizer steps, checkpoint and adapter loads so far) and the version each
    refit path last carried: weights change only through those, so no copy is kept to compare with."""

    current: int = 0
    sent: int | None = None  # the version get_weights last returned
    shared: int | None = None  # the version last written into shared memory

    def bump(self) -> None:
        """The weights changed (an optimizer step, a checkpoint or adapter load)."""
        self.current += 1

    def take_send(self, only_changed: bool) -> bool:
        """Must get_weights send the weights? Yes unless `only_changed` and they were sent at this version;
        records the current version as sent."""
        send = not only_changed or self.sent != self.current
        self.sent = self.current
        return send

    def take_share(self) -> bool:
        """Must share_weights rewrite the shared-memory file? Records the current version as written."""
        share = self.shared != self.current
        self.shared = self.current
        return share


def cast_floating(weights: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype` ("bfloat16", "float32"; None: unchanged), for the receiver's
    precision."""
    if dtype is None:
        return weights
    target = getattr(torch, dtype)
    return {name: t.to(target) if t.is_floating_point() else t for name, t in weights.items()}


def shared_memory_kind(
    colocated: bool,
    lora: bool,
    backend_name: str,
    num_nodes: int,
    num_ranks: int,
    num_gpus_per_worker: float,
    supported: bool,
) -> str | None:
    """How refit shares memory, if it does (colocated: generation and training take turns; one machine).
    Hugging Face generation maps the policy's weights once, and each refit is one in-place cast-and-copy:
    "device": one policy rank and its generation worker on one GPU share a buffer in its memory (CUDA IPC);
    "host": a shared-memory file (the CPU, or several GPUs: each generation worker copies it to its own in
    one copy). vLLM on CPUs reloads its engine from the "host" file. None: the object store. With LoRA the
    adapter alone travels instead (it is smaller still)."""
    if not colocated or lora or num_nodes != 1 or not supported:
        return None
    if backend_name == "vllm":
        return "host" if num_gpus_per_worker == 0 else None
    if backend_name != "hf":
        return None
    return "device" if num_gpus_per_worker > 0 and num_ranks == 1 else "host"


def policy_must_leave(param_bytes: int, device_total_bytes: int, generation_precision: str) -> bool:
    """Would the policy's training state and the generation model crowd one accelerator? True when 4 x
    the policy's parameter bytes (fp32 weights, gradients, two Adam moments) plus the generation weights
    (the same parameters in its precision) exceed half the device; the other half is left for
    activations and the KV cache."""
    generation_bytes = param_bytes * (0.5 if generation_precision == "bfloat16" else 1.0)
    return 4 * param_bytes + generation_bytes > 0.5 * device_total_bytes


class Refit:
    """The driver's side of refit between a `Policy` and a generation backend: whether the generation
    workers hold stale weights, the bytes sent since last asked, and (colocated on accelerators) whether the
    policy's training state leaves the device while generation runs."""

    def __init__(
        self,
        policy: Any,
        generation: Any,
        precision: str,
        shared_memory: str | None,
        move_memory: bool,
        colocated_offload: bool | str = "auto",
        stale: bool = False,
    ) -> None:
        self.policy, self.generation = policy, generation
        self.precision = precision  # the generation workers' dtype: weights travel in it
        self.shared_memory = shared_memory  # "device", "host" or None: see shared_memory_kind
        self.move_memory = move_memory  # colocated on accelerators: the two take turns on the device
        self.colocated_offload = colocated_offload  # True / False / "auto" (see offload_needed)
        self.stale = stale  # the policy has trained since the generation workers' last refit
        self.bytes_sent = 0  # tensor bytes sent to the generation workers since take_bytes_sent
        self.offload_decided: bool | None = None

    def mark_stale(self) -> None:
        """The policy's weights changed: the next generation phase refits."""
        self.stale = True

    def take_bytes_sent(self) -> int:
        """Bytes sent since the last call, then 0."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def weights(self) -> Any:
        """What the generation workers load: a shared-memory handle, or the gathered weights in the object
        store, in the generation precision."""
        if self.shared_memory:
            return self.policy.share_weights(dtype=self.precision, on_device=self.shared_memory == "device")
        return self.policy.get_weights(dtype=self.precision)

    def publish_all(self) -> Any:
        """All of the policy's weights (changed or not) in the object store, for a consumer that may load any
        version after any other (asynchronous generation) or holds none yet (a generation worker that
        replaces a lost one); counted as sent once."""
        weights = self.policy.get_weights(only_changed=False, dtype=self.precision)
        self.bytes_sent += self.policy.last_weights_bytes()
        return weights

    def update_generation(self, weights: Any) -> None:
        """Load `weights` into the generation workers. A refit through GPU memory (CUDA IPC, "device") that
        fails falls back, for the rest of the run, to the pinned host shared-memory file, with one warning
        naming the cause and the setting that avoids the attempt."""
        try:
            self.generation.update_weights(weights)
        except Exception as error:  # noqa: BLE001 - any failure of the fast path: take the measured one
            if self.shared_memory != "device":
                raise
            log.warning(
                "refit through GPU memory (CUDA IPC) failed: %s; refitting through pinned host shared "
                "memory from now on (generation.colocated=false refits through the object store instead)",
                str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
            )
            self.shared_memory = "host"
            self.generation.update_weights(self.weights())

    def offload_needed(self) -> bool:
        """Does the policy's training state leave the device while the generation workers hold it?
        `generation.colocated_offload`: True / False, or "auto": `policy_must_leave` for the rank with the
        largest shard, decided once."""
        if self.colocated_offload != "auto":
            return bool(self.colocated_offload)
        if self.offload_decided is None:
            rank = max(self.policy.memory_footprint(), key=lambda footprint: footprint["param_bytes"])
            self.offload_decided = policy_must_leave(
                rank["param_bytes"], rank["device_total_bytes"], self.precision
            )
        return self.offload_decided

    @contextmanager
    def generation_phase(self, timer: Timer) -> Iterator[None]:
        """The generation workers hold the accelerator: stale weights are gathered (while still on the
        device); colocated, the policy's training state leaves the device when it must (`offload_needed`);
        the generation workers wake up and take the weights. Afterwards they release the device and the
        policy comes back. On CPUs, apart on GPUs, or when both fit, only the refit does any work."""
        weights = None
        if self.stale:
            with timer.time("refit"):
                weights = self.weights()
        move_memory = self.move_memory and self.offload_needed()
        if move_memory:
            self.policy.offload()
            self.generation.prepare_for_generation()
        if weights is not None:
            with timer.time("refit"):
                self.update_generation(weights)
            self.stale = False
            self.bytes_sent += self.policy.last_weights_bytes()  # with LoRA: the adapter only
        try:
            yield
        finally:
            if move_memory:
                self.generation.finish_generation()
                self.policy.onload()
