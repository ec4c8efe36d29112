"""The Megatron backend's config: its keys load from YAML/CLI, and what it cannot run stops the run before
any worker starts, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.algorithms import sft
from posttrain.config import ConfigError, load_typed_config

SFT_TINY = str(Path(__file__).resolve().parents[2] / "configs" / "sft_tiny.yaml")


def load(*overrides: str):
    return load_typed_config(sft.SFTConfig, SFT_TINY, list(overrides))


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(*overrides)
    return str(caught.value)


def test_megatron_keys_load_and_default_to_dtensor():
    assert load().policy.backend == "dtensor"
    cfg = load(
        "policy.backend=megatron",
        "policy.megatron.tensor_model_parallel_size=2",
        "policy.megatron.pipeline_model_parallel_size=2",
        "policy.megatron.sequence_parallel=true",
        "policy.megatron.distributed_optimizer=true",
        "cluster.workers_per_node=4",
        "cluster.num_cpus=4",
    )
    assert (
        cfg.policy.backend,
        cfg.policy.megatron.tensor_model_parallel_size,
        cfg.policy.megatron.pipeline_model_parallel_size,
    ) == ("megatron", 2, 2)
    assert cfg.policy.megatron.sequence_parallel and cfg.policy.megatron.distributed_optimizer


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.backend=fsdp"], "policy.backend"),
        (
            [
                "policy.backend=megatron",
                "policy.tensor_parallel_size=2",
                "cluster.workers_per_node=2",
                "cluster.num_cpus=4",
            ],
            "set policy.megatron.tensor_model_parallel_size",
        ),
        (
            ["policy.backend=megatron", "policy.megatron.sequence_parallel=true"],
            "needs policy.megatron.tensor_model",
        ),
        (
            ["policy.backend=megatron", "policy.sequence_packing.enabled=true"],
            "policy.sequence_packing.enabled: not",
        ),
        (
            ["policy.backend=megatron", "policy.optimizer.name=RMSprop", "~policy.optimizer.kwargs.betas"],
            "policy.optimizer.name: policy.backend=megatron runs",
        ),
        (
            [
                "policy.backend=megatron",
                "policy.megatron.pipeline_model_parallel_size=3",
                "cluster.workers_per_node=2",
                "cluster.num_cpus=4",
            ],
            "pipeline_model_parallel_size = 3 does not divide the 2 workers",
        ),
    ],
)
def test_what_megatron_cannot_run_is_a_config_error(overrides, message):
    assert message in error_of(*overrides)


def test_lora_loads_with_megatron_and_what_it_does_not_cover_names_the_key():
    cfg = load("policy.backend=megatron", "policy.lora.enabled=true")
    assert cfg.policy.lora.enabled and cfg.policy.backend == "megatron"
    assert "policy.lora.target_modules: ['lm_head']" in error_of(
        "policy.backend=megatron", "policy.lora.enabled=true", "++policy.lora.target_modules=[q_proj,lm_head]"
    )
    assert "policy.lora.modules_to_save=['lm_head']" in error_of(
        "policy.backend=megatron", "policy.lora.enabled=true", "++policy.lora.modules_to_save=[lm_head]"
    )
    assert "policy.model_kind=reward_model: not supported" in error_of(
        "policy.backend=megatron", "policy.lora.enabled=true", "policy.model_kind=reward_model"
    )
