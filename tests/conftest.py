"""Shared fixtures: one real local Ray instance for the whole test session."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each test process keeps up to 4 idle worker processes for the runs after it (RayWorkerGroup): most runs
# start no process of their own (a worker's start-up is ~5 CPU-seconds of imports).
os.environ.setdefault("POSTTRAIN_KEEP_WORKERS", "4")

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


# The arithmetic SFT run of the test fixtures: its model at WEAK_SFT_STEPS (the on-policy distillation
# student) and at FINAL_SFT_STEPS (the start model of the DPO, reward-model and RLHF tests, and the teacher).
WEAK_SFT_STEPS = 150
FINAL_SFT_STEPS = 300
SFT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sft_tiny.yaml"
SFT_OVERRIDES = (
    "logger.tensorboard_enabled=false",
    "checkpointing.enabled=false",
    "policy.model.from_config.hidden_size=64",
    "policy.model.from_config.num_layers=2",
    "policy.model.from_config.intermediate_size=256",
    "policy.optimizer.kwargs.lr=3e-3",
    f"sft.max_num_steps={FINAL_SFT_STEPS}",
    "sft.max_val_samples=64",
    "sft.export_final_model=false",
    # Half a CPU each: one torch thread per worker (OMP_NUM_THREADS=1), so the float reductions, and
    # with them the model, do not depend on the machine's core count or on what else runs.
    "cluster.num_cpus_per_worker=0.5",
)


@dataclass(frozen=True)
class ArithmeticSFTModels:
    """Hugging Face directories of one SFT run on the built-in 2-digit addition."""

    final: Path
    """The run's model at step FINAL_SFT_STEPS (validation loss 0.348, strict held-out accuracy 0.41)."""
    weak: Path
    """The same run at step WEAK_SFT_STEPS, before it takes off (validation loss 0.733, accuracy 0.06)."""


def train_arithmetic_sft(out_dir: Path) -> None:
    """The SFT run of `arithmetic_sft_models`, its two models exported under `out_dir`. It stops on the
    step (the data order, the initial weights and the thread count are fixed), and fails if the final
    model's validation loss is not below 0.4."""
    from posttrain.algorithms import sft
    from posttrain.config import load_typed_config

    log_dir = out_dir / "run"
    cfg = load_typed_config(sft.SFTConfig, str(SFT_CONFIG), [f"logger.log_dir={log_dir}", *SFT_OVERRIDES])
    run = sft.setup(cfg)
    try:
        sft.sft_train(run, num_steps=WEAK_SFT_STEPS)
        run.policy.export_hf(str(out_dir / "weak_hf_model"))
        val_loss = sft.sft_train(run, num_steps=FINAL_SFT_STEPS - WEAK_SFT_STEPS)["loss"]
        assert run.step == FINAL_SFT_STEPS, f"the SFT run stopped at step {run.step}"
        assert val_loss < 0.4, (
            f"the SFT start model did not take off in {run.step} steps (val loss {val_loss:.3f})"
        )
        run.policy.export_hf(str(out_dir / "hf_model"))
    finally:
        run.shutdown()


@pytest.fixture(scope="session")
def arithmetic_sft_models(ray_session, tmp_path_factory) -> ArithmeticSFTModels:
    """A small model SFT'd for FINAL_SFT_STEPS steps on the built-in 2-digit addition (it takes off after
    ~250 steps, ~25 s), and the same run's model at step WEAK_SFT_STEPS. Trained once per test run: the
    first pytest process that asks trains it (on its Ray instance, which every user of the models needs
    too), the others reuse its directories (`built_once`, keyed by the posttrain sources, the config and
    the overrides). The final model is the starting point of the DPO, reward-model and RLHF tests and the
    distillation teacher; the weak one is the on-policy distillation student."""
    from built_once import build_key, built_once, shared_dir

    key = build_key([SFT_OVERRIDES, WEAK_SFT_STEPS], files=[SFT_CONFIG])
    models_dir = built_once(shared_dir(tmp_path_factory), "arithmetic_sft", key, train_arithmetic_sft)
    return ArithmeticSFTModels(final=models_dir / "hf_model", weak=models_dir / "weak_hf_model")


@pytest.fixture(scope="session")
def arithmetic_sft_model(arithmetic_sft_models) -> Path:
    """The Hugging Face directory of the SFT model trained until its validation loss fell below 0.4."""
    return arithmetic_sft_models.final


# The number of test files the end of a run lists by their time (with pytest's --durations for tests).
SLOWEST_FILES = 15


def pytest_terminal_summary(terminalreporter) -> None:
    """The test files that took the longest (setup, call and teardown of their tests, summed), so that the
    suite's growth shows at the end of every run; make test adds the slowest tests (--durations)."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid"):
                path = report.nodeid.split("::")[0]
                seconds[path] = seconds.get(path, 0.0) + report.duration
    if len(seconds) < 2:
        return
    terminalreporter.write_sep("=", f"slowest {SLOWEST_FILES} test files")
    for path, total in sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{total:8.1f}s {path}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}s in all ({len(seconds)} files)")
