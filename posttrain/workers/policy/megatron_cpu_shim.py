"""Runs Megatron Core on a CPU (gloo), which is what lets CI test the Megatron backend without a GPU.

megatron-core hard-codes CUDA in a few places on the training path: `torch.cuda.current_device()` and
`torch.cuda.synchronize()`, the CUDA RNG tracker, `device="cuda"` in schedules, grad clipping and the
optimizer, and `grad.type() == "torch.cuda.FloatTensor"` checks (clipping, distributed optimizer).
`cpu_shim()` redirects them for the code run inside it: a `TorchFunctionMode` maps every CUDA device
argument to the CPU and reports CPU float tensors as their CUDA type; `torch.cuda.current_device` (which
returns "cpu", also in backward passes, where the mode is not active) and `synchronize` become CPU-safe
for the whole process; the RNG tracker becomes Megatron's own no-op (inference) tracker, so
dropout uses torch's CPU generator. The model is given an explicit causal mask (Megatron builds its
default one on CUDA). Only used when the worker has no CUDA device; checked against the one
megatron-core version it was written and tested for."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

TESTED_MEGATRON_CORE_VERSION = "0.16.1"


def check_megatron_version() -> None:
    """RuntimeError unless the installed megatron-core is the version this shim was tested with."""
    from megatron.core import package_info

    if package_info.__version__ != TESTED_MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"policy.backend=megatron on a CPU needs megatron-core=={TESTED_MEGATRON_CORE_VERSION} (its CPU "
            f"shim patches that version's CUDA-only calls); found {package_info.__version__}. "
            f"Install it with `pip install 'posttrain[megatron]'`."
        )


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device is a CUDA ordinal


def _to_cpu(value: Any) -> Any:
    return torch.device("cpu") if _is_cuda(value) else value


class CudaToCpuMode(TorchFunctionMode):
    """Every CUDA device argument becomes the CPU; `.cuda()` is a no-op; `.type()` names CPU float
    tensors as CUDA ones (Megatron picks its code path by that string)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _patch_cuda_module() -> None:
    """CPU-safe `torch.cuda.current_device` and `synchronize`. The device is "cpu" itself, not an ordinal
    for the mode to map: backward functions run outside the mode and allocate on `current_device()`."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None


def use_cpu_rng_tracker() -> None:
    """Megatron's no-op RNG tracker (its inference tracker) instead of the CUDA one."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


_installed = False


def install() -> None:
    """Process-wide part of the shim (call once, in a worker without a GPU)."""
    global _installed
    if _installed:
        return
    check_megatron_version()
    # a CUDA tuning hint, printed once per tensor-parallel layer: meaningless on a CPU
    warnings.filterwarnings("ignore", message="When using async grad allreduce it is recommended")
    _patch_cuda_module()
    use_cpu_rng_tracker()
    _installed = True


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Megatron calls made inside run on the CPU (installs the process-wide part on first use)."""
    install()
    with CudaToCpuMode():
        yield
