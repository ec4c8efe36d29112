"""Weights shared through memory by the processes of one machine.

The policy's rank 0 writes its full weights into one flat buffer, in the generation precision, with one
cast-and-copy call (`torch._foreach_copy_`); generation workers on the same machine use views of it as
their model's parameters (tied weights are one parameter, written once). A refit is then that one copy on
the policy's side (~30 ms for 540 MB on a CPU) and nothing travels through the object store. The buffer is
- on a GPU shared with the generation worker: device memory, opened by the reader through a CUDA IPC
  handle (the policy's writes are the generator's weights);
- elsewhere: an anonymous shared-memory file (a memfd), pinned for the GPU's copies when either side
  computes on one; a generation worker on a GPU holds its weights in one flat device buffer of its own,
  refreshed from the file with one host-to-device copy per refit.
The file has no name on disk: it lives while a process holds it open or mapped, so a crash leaks nothing.

The writer and readers must never run at the same time (the synchronous GRPO loop with colocated
generation: generation and training take turns). Linux only (memfd and /proc); elsewhere
`shared_memory_supported()` is False and refit goes through Ray's object store."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

ALIGNMENT = 64  # bytes: every tensor starts on a cache line


@dataclass(frozen=True)
class TensorSlot:
    offset: int  # bytes from the start of the file
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    nbytes: int


@dataclass(frozen=True)
class SharedWeights:
    """A handle that travels to the readers: where the file is and what lies where."""

    path: str  # /proc/<writer pid>/fd/<fd>: opens the writer's memfd from another process of its machine
    node_id: str  # the Ray node of the writer; only processes there can map the file
    slots: dict[str, TensorSlot]
    size: int  # bytes
    cuda_ipc: tuple | None = None  # a device buffer: torch's CUDA IPC reduction of it (else the file at path)
    device_uuid: str | None = None  # the GPU that holds that buffer


def shared_memory_supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def plan_slots(tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[str, TensorSlot], int]:
    """Aligned byte offsets for named (shape, dtype) pairs; returns the slots and the file size."""
    slots, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slots[name] = TensorSlot(offset, tuple(shape), str(dtype).removeprefix("torch."), nbytes)
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    return slots, max(offset, ALIGNMENT)


def slot_views(buffer: torch.Tensor, slots: dict[str, TensorSlot]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of a flat uint8 buffer."""
    views = {}
    for name, slot in slots.items():
        flat = buffer[slot.offset : slot.offset + slot.nbytes]
        views[name] = flat.view(getattr(torch, slot.dtype)).view(slot.shape)
    return views


def pin(buffer: torch.Tensor) -> None:
    """Page-lock a host buffer for the GPU's copies (cudaHostRegister); left pageable where that fails."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class SharedWeightsWriter:
    """Owns the flat buffer (a memfd, or on a GPU `device` its memory); `write` copies new weights in."""

    def __init__(
        self,
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
        node_id: str,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        slots, size = plan_slots(tensors)
        self.fd = None
        if device.type == "cuda":
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            ipc = reduce_tensor(buffer)[1]
            self.handle = SharedWeights("", node_id, slots, size, ipc, gpu_uuid(device))
        else:
            self.fd = os.memfd_create("posttrain-weights")
            os.ftruncate(self.fd, size)
            buffer = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=size, dtype=torch.uint8)
            pin(buffer)
            self.handle = SharedWeights(f"/proc/{os.getpid()}/fd/{self.fd}", node_id, slots, size)
        self.buffer = buffer
        self.views = slot_views(buffer, slots)

    def write(self, weights: dict[str, torch.Tensor]) -> None:
        """One cast-and-copy of `weights` (the slots' names) into the buffer; returns once it is there."""
        targets, sources = [self.views[name] for name in weights], list(weights.values())
        if all(t.device == self.buffer.device for t in sources):
            torch._foreach_copy_(targets, sources)
        else:  # a GPU's weights into a host file: copies in flight together, then one wait
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=True)
        if any(t.is_cuda for t in weights.values()) or self.buffer.is_cuda:
            torch.cuda.synchronize()  # the readers are other processes: the copy must be done

    def close(self) -> None:
        """Drop the writer's descriptor; readers' mappings stay valid."""
        if self.fd is not None:
            os.close(self.fd)


class SharedWeightsReader:
    """A reader's flat buffer (the writer's, or a GPU reader's device copy of the file) and `views` of it."""

    def __init__(self, handle: SharedWeights, node_id: str, device: torch.device) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if node_id != handle.node_id:
            raise RuntimeError(
                f"shared weights live on Ray node {handle.node_id}, this worker runs on {node_id}: "
                "shared-memory refit needs the policy's rank 0 and the generation workers on one machine"
            )
        self.handle, self.file = handle, None
        if handle.cuda_ipc is not None:
            if device.type != "cuda" or gpu_uuid(device) != handle.device_uuid:
                raise RuntimeError(
                    f"shared weights are in the memory of GPU {handle.device_uuid}; this worker computes on "
                    f"{device}: a device refit needs the generation worker on the policy's GPU"
                )
            ipc = list(handle.cuda_ipc)
            ipc[6] = device.index if device.index is not None else torch.cuda.current_device()
            self.buffer = rebuild_cuda_tensor(*ipc)
        else:
            self.file = torch.from_file(handle.path, shared=True, size=handle.size, dtype=torch.uint8)
            self.buffer = self.file
            if device.type == "cuda":
                pin(self.file)
                self.buffer = torch.empty(handle.size, dtype=torch.uint8, device=device)
        self.views = slot_views(self.buffer, handle.slots)
        self.refresh()

    def refresh(self) -> None:
        """After the writer wrote: a device copy of a file takes the new bytes (one copy); views of the
        writer's own buffer already hold them."""
        if self.file is not None and self.buffer is not self.file:
            self.buffer.copy_(self.file, non_blocking=True)
            torch.cuda.current_stream(self.buffer.device).synchronize()


def use_as_parameters(model: torch.nn.Module, views: dict[str, torch.Tensor]) -> None:
    """Make every parameter of `model` the view of its name (a tied weight is one parameter: its aliases
    follow); fails naming the parameters missing from `views`, unknown to the model, or of another shape or
    dtype."""
    parameters = dict(model.named_parameters())  # a tied weight once; its alias may be in views
    missing, unknown = set(parameters) - set(views), set(views) - set(model.state_dict())
    if missing or unknown:
        raise KeyError(
            f"update_weights: shared weights lack {sorted(missing)[:5]}, have unknown {sorted(unknown)[:5]}"
        )
    for name, parameter in parameters.items():
        if views[name].shape != parameter.shape or views[name].dtype != parameter.dtype:
            raise ValueError(
                f"update_weights: {name} is {tuple(views[name].shape)} {views[name].dtype} in "
                f"shared memory, the model has {tuple(parameter.shape)} {parameter.dtype}"
            )
        parameter.data = views[name]
