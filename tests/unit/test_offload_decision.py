"""`generation.colocated_offload: auto`: the policy leaves the GPU only when it and the generation model
would crowd it (4 x parameter bytes + generation weights > half the device); a refit through GPU memory
that fails falls back to the host shared-memory file."""

import pytest

from posttrain.workers.refit import policy_must_leave

GIB = 1024**3


def test_small_models_stay_and_large_ones_leave_an_80_gib_gpu():
    """0.5B fp32 (2 GiB of weights): 8 + 1 (bf16 generation) = 9 GiB <= 40: stays. 7B fp32 (28 GiB):
    112 + 14 = 126 GiB > 40: leaves. 2.2B (8.8 GiB): 35.2 + 8.8 (fp32 generation) = 44 > 40: leaves,
    but 35.2 + 4.4 (bf16 generation) = 39.6 <= 40 stays."""
    assert not policy_must_leave(2 * GIB, 80 * GIB, "bfloat16")
    assert policy_must_leave(28 * GIB, 80 * GIB, "bfloat16")
    assert policy_must_leave(int(8.8 * GIB), 80 * GIB, "float32")
    assert not policy_must_leave(int(8.8 * GIB), 80 * GIB, "bfloat16")


class SharingPolicy:
    """The policy's side of a shared-memory refit: a handle per place (GPU memory or the host file)."""

    def share_weights(self, dtype: str | None = None, on_device: bool = False) -> str:
        return "gpu-buffer" if on_device else "host-file"

    def last_weights_bytes(self) -> int:
        return 100


class GenerationWithoutIPC:
    """Generation workers whose GPU cannot open another process's CUDA IPC handle."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def update_weights(self, handle: str) -> None:
        if handle == "gpu-buffer":
            raise RuntimeError("CUDA error: cudaIpcOpenMemHandle failed: invalid device context")
        self.loaded.append(handle)


def test_a_failing_device_refit_falls_back_to_host_shared_memory_with_one_warning(caplog):
    """Refit through GPU memory raises in the generation workers: the same refit loads the host file, one
    warning names the cause and the knob, and later refits go to the host file directly. A failure of any
    other path is the run's error."""
    from posttrain.utils.timer import Timer
    from posttrain.workers.refit import Refit

    generation = GenerationWithoutIPC()
    refit = Refit(SharingPolicy(), generation, "bfloat16", "device", move_memory=False, stale=True)
    with caplog.at_level("WARNING", logger="posttrain.workers.refit"):
        for _ in range(2):
            with refit.generation_phase(Timer()):
                pass
            refit.mark_stale()
    assert generation.loaded == ["host-file", "host-file"] and refit.shared_memory == "host"
    assert [r.getMessage().count("cudaIpcOpenMemHandle") for r in caplog.records] == [1]
    assert "generation.colocated=false" in caplog.records[0].getMessage()
    failing_host = Refit(SharingPolicy(), GenerationWithoutIPC(), "bfloat16", None, move_memory=False)
    failing_host.policy.get_weights = lambda dtype=None: "gpu-buffer"
    failing_host.mark_stale()
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle"):
        with failing_host.generation_phase(Timer()):
            pass
