"""Shared fixtures: one real local Ray instance for the whole test session."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Logical CPUs for the test Ray instance: more than the 2 physical cores so that
# fractional actors of several worker groups fit at once.
RAY_TEST_NUM_CPUS = 8


def workers_python_path() -> str:
    """PYTHONPATH for Ray workers: they must import classes defined in test modules (pytest imports them
    as top-level modules)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(
        [
            os.path.join(tests_dir, "integration"),
            os.path.join(tests_dir, "unit"),
            os.environ.get("PYTHONPATH", ""),
        ]
    )


def start_test_ray() -> None:
    """The tests' local Ray instance, started the way posttrain starts one (127.0.0.1 only, token
    authentication on), with the full dashboard agent for the system-monitor test."""
    from posttrain.distributed.virtual_cluster import start_local_ray

    start_local_ray(
        RAY_TEST_NUM_CPUS,
        dashboard_agent=True,
        log_to_driver=False,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": workers_python_path()}},
    )


@pytest.fixture(scope="session")
def ray_session():
    """Start (once) and yield the tests' local Ray instance; shut it down at the end. A module that needs a
    cluster of several nodes stops it and starts it again afterwards (test_multinode)."""
    import ray

    if not ray.is_initialized():
        start_test_ray()
    yield ray
    ray.shutdown()


# The on-policy distillation tests' weak student: the teacher's own SFT run, exported at this step.
WEAK_SFT_STEPS = 150


@dataclass(frozen=True)
class ArithmeticSFTModels:
    """Hugging Face directories of one SFT run on the built-in 2-digit addition."""

    final: Path
    """Trained until its validation loss fell below 0.4."""
    weak: Path
    """The same run at step WEAK_SFT_STEPS, before it takes off (validation loss ~0.73)."""


@pytest.fixture(scope="session")
def arithmetic_sft_models(ray_session, tmp_path_factory) -> ArithmeticSFTModels:
    """A small model SFT'd on the built-in 2-digit addition until its validation loss falls below 0.4
    (it takes off after ~250 steps, ~25 s), and the same run's model at step WEAK_SFT_STEPS. The final
    model is the starting point of the DPO, reward-model and RLHF tests and the distillation teacher; the
    weak one is the on-policy distillation student."""
    from posttrain.algorithms import sft
    from posttrain.config import load_typed_config

    log_dir = tmp_path_factory.mktemp("arithmetic_sft")
    config = Path(__file__).resolve().parents[1] / "configs" / "sft_tiny.yaml"
    cfg = load_typed_config(
        sft.SFTConfig,
        str(config),
        [
            f"logger.log_dir={log_dir}",
            "logger.tensorboard_enabled=false",
            "checkpointing.enabled=false",
            "policy.model.from_config.hidden_size=64",
            "policy.model.from_config.num_layers=2",
            "policy.model.from_config.intermediate_size=256",
            "policy.optimizer.kwargs.lr=3e-3",
            "sft.max_num_steps=600",
            "sft.val_max_samples=64",
            "sft.export_final_model=false",
            "cluster.num_cpus_per_worker=0.5",
        ],
    )
    models = ArithmeticSFTModels(final=log_dir / "hf_model", weak=log_dir / "weak_hf_model")
    run = sft.setup(cfg)
    try:
        val_loss = float("inf")
        while (val_loss >= 0.4 or run.step < WEAK_SFT_STEPS) and run.step < run.total_steps:
            val_loss = sft.sft_train(run, num_steps=25)["loss"]
            if run.step == WEAK_SFT_STEPS:
                run.policy.export_hf(str(models.weak))
        assert val_loss < 0.4, (
            f"the SFT start model did not take off in {run.step} steps (val loss {val_loss:.3f})"
        )
        run.policy.export_hf(str(models.final))
    finally:
        run.shutdown()
    return models


@pytest.fixture(scope="session")
def arithmetic_sft_model(arithmetic_sft_models) -> Path:
    """The Hugging Face directory of the SFT model trained until its validation loss fell below 0.4."""
    return arithmetic_sft_models.final
