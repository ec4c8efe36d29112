"""Config checks of asynchronous GRPO: it needs generation workers of its own and, when it may train on
stale trajectories, the importance-sampling correction; errors name the key and where it was set."""

from pathlib import Path

import pytest

from posttrain.algorithms.grpo import GRPOConfig
from posttrain.config import ConfigError, load_typed_config

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml")


def test_the_tiny_config_runs_async_with_separate_generation():
    cfg = load_typed_config(
        GRPOConfig, CONFIG, ["grpo.async_grpo.enabled=true", "generation.colocated=false"]
    )
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1


def test_async_with_colocated_generation_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, ["grpo.async_grpo.enabled=true"])
    assert error.value.key == "grpo.async_grpo.enabled"
    assert "generation.colocated=false" in str(error.value) and "command line" in str(error.value)


def test_lending_cores_to_the_vllm_backend_is_refused_naming_the_key():
    base = [
        "grpo.async_grpo.enabled=true",
        "generation.colocated=false",
        "grpo.async_grpo.lend_idle_cores=true",
    ]
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, base + ["generation.backend=vllm"])
    assert error.value.key == "grpo.async_grpo.lend_idle_cores" and "generation.backend=hf" in str(
        error.value
    )
    assert load_typed_config(
        GRPOConfig, CONFIG, base + ["generation.backend=hf"]
    ).grpo.async_grpo.lend_idle_cores


def test_stale_trajectories_need_the_importance_sampling_correction():
    base = [
        "grpo.async_grpo.enabled=true",
        "generation.colocated=false",
        "loss.use_importance_sampling_correction=false",
    ]
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, base)
    assert error.value.key == "loss.use_importance_sampling_correction"
    cfg = load_typed_config(GRPOConfig, CONFIG, base + ["grpo.async_grpo.max_trajectory_age_steps=0"])
    assert cfg.grpo.async_grpo.max_trajectory_age_steps == 0  # on-policy: no correction needed


def test_a_negative_age_bound_is_refused():
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, ["grpo.async_grpo.max_trajectory_age_steps=-1"])
    assert error.value.key == "grpo.async_grpo.max_trajectory_age_steps"


def test_the_demo_switch_builds_a_valid_async_config(tmp_path):
    from posttrain.demo import DemoConfig, grpo_config

    cfg = grpo_config(DemoConfig(grpo_async=True, grpo_max_trajectory_age=2), tmp_path, tmp_path)
    cfg.validate()
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 2
    assert not cfg.generation.colocated and cfg.loss.truncated_importance_sampling_ratio == 2.0
    assert grpo_config(DemoConfig(), tmp_path, tmp_path).generation.colocated  # the default stays synchronous


def test_the_step_by_step_recipe_runs_async_as_its_header_says():
    """configs/grpo_smollm2_steps.yaml's asynchronous command line (its header) validates: generation on a
    worker of its own, trainer and generator with one core each lent to the side that works, stale samples
    corrected."""
    path = Path(CONFIG).parent / "grpo_smollm2_steps.yaml"
    header = [
        line.lstrip("# ").rstrip(" \\") for line in path.read_text().splitlines() if line.startswith("#")
    ]
    start = next(i for i, line in enumerate(header) if "grpo.async_grpo.enabled=true" in line)
    words = " ".join(header[start : start + 3]).split()
    overrides = [word for word in words if "=" in word]
    assert len(overrides) == 6, overrides
    cfg = load_typed_config(GRPOConfig, str(path), overrides)
    assert (
        cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.lend_idle_cores and not cfg.generation.colocated
    )
    assert cfg.cluster.num_cpus_per_worker == cfg.generation.num_cpus_per_worker == 1.0
    assert cfg.loss.use_importance_sampling_correction and cfg.data.dataset == "math_steps"


def test_partial_rollouts_need_async_grpo_and_the_hf_backend_and_a_positive_chunk():
    base = ["grpo.async_grpo.partial_rollouts=true"]
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, base)
    assert error.value.key == "grpo.async_grpo.partial_rollouts"
    assert "grpo.async_grpo.enabled=true" in str(error.value)
    on = base + ["grpo.async_grpo.enabled=true", "generation.colocated=false"]
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, on + ["generation.backend=vllm"])
    assert error.value.key == "grpo.async_grpo.partial_rollouts"
    assert "generation.backend=hf" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, CONFIG, on + ["grpo.async_grpo.partial_rollout_chunk_tokens=0"])
    assert error.value.key == "grpo.async_grpo.partial_rollout_chunk_tokens"
    cfg = load_typed_config(GRPOConfig, CONFIG, on + ["grpo.async_grpo.partial_rollout_chunk_tokens=4"])
    assert cfg.grpo.async_grpo.partial_rollouts and cfg.grpo.async_grpo.partial_rollout_chunk_tokens == 4
