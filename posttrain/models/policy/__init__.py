"""The trainable policy: typed config, the FSDP2/DTensor training worker (or the Megatron Core one,
`megatron_worker.py`) and the driver-side handle."""

from posttrain.models.policy.config import (
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
    """`Policy` and `DTensorPolicyWorker` load on first use, so that importing configs stays light (no Ray)."""
    if name == "Policy":
        from posttrain.models.policy.policy import Policy

        return Policy
    if name == "DTensorPolicyWorker":
        from posttrain.models.policy.worker import DTensorPolicyWorker

        return DTensorPolicyWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
