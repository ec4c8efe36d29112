"""`generation.colocated_offload: auto`: the policy leaves the GPU only when it and the generation model
would crowd it (4 x parameter bytes + generation weights > half the device)."""

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
