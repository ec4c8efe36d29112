"""The trainable policy: its typed config (`config.py`), the worker base every backend shares (`base.py`),
the DTensor/FSDP2 worker (`dtensor.py`) and the Megatron Core one (`megatron.py`), and the driver-side
handle (`handle.py`, `Policy`)."""

from posttrain.workers.policy.config import (
    DynamicBatchingConfig,
    MegatronConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
)

__all__ = [
    "DTensorPolicyWorker",
    "Policy",
    "DynamicBatchingConfig",
    "MegatronConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
]


def __getattr__(name: str):
    """`Policy` and `DTensorPolicyWorker` load on first use, so that importing configs stays light (no
    Ray)."""
    if name == "Policy":
        from posttrain.workers.policy.handle import Policy

        return Policy
    if name == "DTensorPolicyWorker":
        from posttrain.workers.policy.dtensor import DTensorPolicyWorker

        return DTensorPolicyWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
