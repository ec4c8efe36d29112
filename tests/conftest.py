"""Shared fixtures: one real local Ray instance for the whole test session."""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Logical CPUs for the test Ray instance: more than the 2 physical cores so that
# fractional actors of several worker groups fit at once.
RAY_TEST_NUM_CPUS = 8


@pytest.fixture(scope="session")
def ray_session():
    """Start (once) and yield a local Ray instance; shut it down at the end of the session."""
    import ray

    # Workers must import classes defined in test modules (pytest imports them as top-level modules).
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(
        [os.path.join(tests_dir, "integration"), os.path.join(tests_dir, "unit"), os.environ.get("PYTHONPATH", "")]
    )
    if not ray.is_initialized():
        ray.init(
            num_cpus=RAY_TEST_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {
                "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path,
            }},
        )
    yield ray
    ray.shutdown()
