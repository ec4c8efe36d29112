"""Asynchronous GRPO on real Ray workers: with age bound 0 it equals the synchronous loop (1 generation
worker lending its idle cores, or 2 workers, one of them lost mid-batch); with bound 2 every trained batch
is exactly as old as the schedule says and never older than the bound; a resumed run keeps its trajectory
accounting, and equals an uninterrupted one with bound 0."""

import pytest
from test_grpo import run_grpo

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

ASYNC = {"grpo.async_grpo.enabled": "true", "generation.colocated": "false"}
NO_CHECKPOINTS = {"checkpointing.enabled": "false"}


@pytest.fixture(scope="module")
def sync_run(ray_session, tmp_path_factory) -> dict[int, dict]:
    """The metrics by step of the synchronous loop's run that the age-0 runs are compared with: 3 steps
    (validation at step 2), no checkpoints."""
    return run_grpo(tmp_path_factory.mktemp("sync"), **{"grpo.max_num_steps": 3, **NO_CHECKPOINTS})


def test_async_with_age_0_equals_the_synchronous_loop_with_one_or_two_generation_workers(
    ray_session, tmp_path, monkeypatch, capsys, sync_run
):
    """Two global batches per step (prev_logprobs recomputed in both modes), validation at step 2. With 1
    generation worker, `lend_idle_cores`: the generator waits for each step's weights while the trainer
    trains, so every micro-batch of the trainer (logprobs and training) runs with the generator's threads
    added (timed as borrowed_threads). With 2 generation workers, rank 1 dies while the producer thread
    generates step 2's batch (with the weights of step 1): the handle replaces it with the weights of the
    producer's version and generates its samples again. Both runs equal the synchronous one."""
    from lost_generation_worker import dies_once_worker

    from posttrain.workers.generation import HFGeneration

    steps = {"grpo.max_num_steps": 3, **NO_CHECKPOINTS}
    sync = sync_run
    for num_workers in (1, 2):
        if num_workers == 2:
            monkeypatch.setattr(HFGeneration, "worker_cls", dies_once_worker(tmp_path / "died", on_call=2))
        run = run_grpo(
            tmp_path / f"async{num_workers}",
            **steps,
            **ASYNC,
            **{"grpo.async_grpo.max_trajectory_age_steps": 0, "generation.num_workers": num_workers},
            **{"grpo.async_grpo.lend_idle_cores": str(num_workers == 1).lower()},
        )
        for step in (1, 2, 3):
            assert run[step]["train/loss"] == pytest.approx(sync[step]["train/loss"], abs=1e-6)
            assert run[step]["train/reward_mean"] == pytest.approx(sync[step]["train/reward_mean"], abs=1e-6)
            assert run[step]["train/async/trajectory_age_max"] == 0.0
            assert run[step]["train/async/trained_trajectories_total"] == 16.0 * step
            borrowed = run[step].get("timing/policy_worker/borrowed_threads", 0.0)
            worker = run[step]["timing/policy_worker/train"] + run[step]["timing/policy_worker/logprobs"]
            assert 0.5 * worker < borrowed <= worker if num_workers == 1 else borrowed == 0.0
            assert "timing/policy_worker/borrowed_threads" not in sync[step]
        assert run[2]["val/accuracy"] == pytest.approx(sync[2]["val/accuracy"])
    assert sync[3]["train/loss"] != 0.0
    assert (tmp_path / "died").exists()
    out = capsys.readouterr().out
    assert (
        "generation: lost worker(s) hf_generation-1-" in out
        and "generating samples again: [8, 16) on rank 1" in out
    )


def test_no_trained_trajectory_is_older_than_the_bound(ray_session, tmp_path):
    """Bound 2 over 5 steps (ages 0, 1, 2, 2, 2). One global batch per step, so pi_prev comes from the
    trained forward (no `logprobs` stage) for stale data too; the truncated importance weight against the
    generating weights stays near 1."""
    max_age = 2
    run = run_grpo(
        tmp_path,
        **ASYNC,
        **NO_CHECKPOINTS,
        **{
            "grpo.max_num_steps": 5,
            "grpo.async_grpo.max_trajectory_age_steps": max_age,
            "policy.train_global_batch_size": 16,
            "grpo.val_period": 3,
        },
    )
    for step in range(1, 6):
        metrics = run[step]
        assert metrics["train/async/trajectory_age_max"] == min(max_age, step - 1) <= max_age
        assert metrics["train/async/dropped_stale_trajectories"] == 0.0
        assert metrics["train/async/trained_trajectories_total"] == 16.0 * step
        assert "timing/logprobs" not in metrics
        assert metrics["train/async/buffer_trajectories"] <= 16.0 * max_age
        assert 0.5 < metrics["train/is_weight_mean"] < 2.0
    assert "val/accuracy" in run[3]


def test_async_resume_continues_with_consistent_accounting(ray_session, tmp_path):
    """Bound 1, checkpoint at step 2: after the resume the in-flight batch of step 3 is regenerated from
    the saved loader position with the restored weights (age 0, where an uninterrupted run trains a batch
    1 step old), and the totals continue from the checkpoint."""
    settings = {**ASYNC, "grpo.val_period": 0}
    first = run_grpo(tmp_path, **settings, **{"grpo.max_num_steps": 2})
    resumed = run_grpo(tmp_path, **settings, **{"grpo.max_num_steps": 4})
    assert [first[s]["train/async/trajectory_age_max"] for s in (1, 2)] == [0.0, 1.0]
    assert [resumed[s]["train/async/trajectory_age_max"] for s in (3, 4)] == [0.0, 1.0]
    for step in (3, 4):
        assert resumed[step]["train/async/trained_trajectories_total"] == 16.0 * step
        assert resumed[step]["train/async/dropped_trajectories_total"] == 0.0


def test_async_resume_with_age_0_equals_uninterrupted(ray_session, tmp_path, capsys, sync_run):
    """Stopped after step 2 and resumed, step 3 equals the uninterrupted synchronous run's (which the
    age-0 asynchronous run equals, above)."""
    settings = {**ASYNC, "grpo.val_period": 0, "grpo.async_grpo.max_trajectory_age_steps": 0}
    run_grpo(tmp_path, **settings, **{"grpo.max_num_steps": 2})
    resumed = run_grpo(tmp_path, **settings, **{"grpo.max_num_steps": 3})
    assert "checkpoints/step_2 (step 2)" in capsys.readouterr().err  # it resumed after step 2
    assert resumed[3]["train/loss"] == pytest.approx(sync_run[3]["train/loss"], abs=1e-6)
    assert resumed[3]["train/reward_mean"] == pytest.approx(sync_run[3]["train/reward_mean"], abs=1e-6)
