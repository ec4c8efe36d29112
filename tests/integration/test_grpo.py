"""GRPO end to end on real Ray workers: every stage logged, generation/training logprobs agree, resume
equals uninterrupted, colocated equals separate generation, and multi-turn rollouts with a game."""

from pathlib import Path

import pytest
import torch
from run_logs import as_overrides, metrics_by_step, run_to_end
from tiny_model import tiny_from_config

from posttrain.algorithms import grpo
from posttrain.config import load_typed_config
from posttrain.environments import EnvironmentConfig, create_environments
from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, last_assistant_text
from posttrain.experience.rollouts import records_to_rollout_batch, run_multi_turn_rollout
from posttrain.models.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "grpo_tiny.yaml")


class DigitShareEnvironment(EnvironmentInterface):
    """Reward = share of digits in the response: an untrained model already gets a varied reward."""

    def step(self, message_logs, metadata):
        texts = [last_assistant_text(log).replace("<eos>", "") for log in message_logs]
        rewards = [sum(c.isdigit() for c in t) / max(1, len(t)) for t in texts]
        n = len(texts)
        return EnvironmentReturn(
            [{"role": "environment", "content": ""}] * n,
            metadata,
            [None] * n,
            torch.tensor(rewards),
            torch.ones(n, dtype=torch.bool),
            texts,
        )


def overrides(log_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model_name": "null",
        "policy.model.from_config": tiny_from_config(tie_word_embeddings=False, seed=3),
        "grpo.num_prompts_per_step": 4,
        "grpo.num_generations_per_prompt": 4,
        "grpo.max_val_samples": 8,
        "grpo.val_period": 2,
        "grpo.val_at_start": "false",
        "policy.train_global_batch_size": 8,
        "policy.train_micro_batch_size": 4,
        "policy.optimizer.kwargs.lr": 0.01,
        "generation.max_new_tokens": 6,
        "env.arithmetic.cls": "test_grpo:DigitShareEnvironment",
        "data.num_train": 64,
        "data.num_val": 8,
        "cluster.num_cpus_per_worker": 0.5,
        "checkpointing.save_period": 2,
    }
    return as_overrides(values, extra)


def run_grpo(log_dir, **extra) -> dict[int, dict]:
    cfg = load_typed_config(grpo.GRPOConfig, CONFIG, overrides(log_dir, **extra))
    return run_to_end(cfg, grpo.setup, grpo.grpo_train)


def test_a_short_run_logs_every_stage_and_keeps_logprobs_consistent(ray_session, tmp_path):
    """The 16 samples of a step are one global batch here: the trained forward gives pi_prev, so there is
    no separate logprobs stage (the other tests train two global batches per step and have one)."""
    steps = run_grpo(
        tmp_path,
        **{
            "grpo.max_num_steps": 3,
            "policy.train_global_batch_size": 16,
            "grpo.health.kl_to_start_period": 2,
        },
    )
    assert steps[1]["train/health/kl_to_start"] == 0.0  # trained forward of step 1: the start itself
    assert steps[2]["train/health/kl_to_start"] > 0.0 and "train/health/kl_to_start" not in steps[3]
    for step in (1, 2, 3):
        metrics = steps[step]
        assert 0.0 <= metrics["train/health/zero_signal_share"] <= 1.0
        assert metrics["train/health/entropy"] == metrics["train/approx_entropy"] > 0
        assert metrics["train/health/mean_reply_length"] == metrics["train/rollout/mean_generated_length"]
        for stage in ("generation", "rewards", "advantages", "training"):
            assert metrics[f"timing/{stage}"] > 0
        assert "timing/logprobs" not in metrics
        # The generation workers start with the policy's weights: the first refit comes with step 2.
        assert ("timing/refit" in metrics) == (step > 1)
        assert 1.0 <= metrics["train/token_mult_prob_error"] <= 1.01
        assert 0.0 <= metrics["train/reward_mean"] <= 1.0
    assert "val/accuracy" in steps[2] and (tmp_path / "val_samples" / "step_2.jsonl").exists()
    assert (tmp_path / "checkpoints" / "step_2" / "training_info.json").exists()
    assert any(steps[s]["train/reward_mean"] > 0 for s in (1, 2, 3))  # the reward has signal


def test_a_run_whose_rewards_are_all_zero_warns_of_a_stall_at_step_3(ray_session, tmp_path, caplog):
    """An untrained model never writes the exact sum: every group's rewards are all 0, no gradient."""
    with caplog.at_level("WARNING", logger="posttrain.algorithms.health"):
        steps = run_grpo(
            tmp_path,
            **{"grpo.max_num_steps": 3, "grpo.val_period": 0, "env.arithmetic.cls": "exact_match"},
        )
    assert [steps[s]["train/health/zero_signal_share"] for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
    warnings = [r.getMessage() for r in caplog.records if r.name == "posttrain.algorithms.health"]
    assert len(warnings) == 1 and warnings[0].startswith("step 3: learning has stalled"), warnings


def test_resume_equals_uninterrupted(ray_session, tmp_path):
    """Bit-identical through sampling-dependent steps: rollouts are sampled with per-step seeds and the
    trainer's attention dropout (0.2) draws from each worker's RNG, which the checkpoint restores. The
    second run starts from the first one's step-2 checkpoint (`checkpointing.resume_from`)."""
    dropout = {"+policy.model.from_config.attention_dropout": 0.2}  # from_config is set as a whole above
    uninterrupted = run_grpo(tmp_path / "full", **{"grpo.max_num_steps": 4}, **dropout)
    step_2 = {"checkpointing.resume_from": str(tmp_path / "full" / "checkpoints" / "step_2")}
    resumed = run_grpo(tmp_path / "resumed", **{"grpo.max_num_steps": 4}, **dropout, **step_2)
    assert min(step for step, metrics in resumed.items() if "train/loss" in metrics) == 3  # after step 2
    for step in (3, 4):
        assert resumed[step]["train/reward_mean"] == uninterrupted[step]["train/reward_mean"]
        assert resumed[step]["train/loss"] == uninterrupted[step]["train/loss"]
    assert uninterrupted[3]["train/loss"] != 0.0


# Two steps (validation at step 2) with generation on 2 workers of its own.
SEPARATE = {
    "grpo.max_num_steps": 2,
    "checkpointing.enabled": "false",
    "generation.colocated": "false",
    "generation.num_workers": 2,
}


@pytest.fixture(scope="module")
def separate_generation_run(ray_session, tmp_path_factory) -> dict[int, dict]:
    """The metrics by step of a run with SEPARATE's settings."""
    return run_grpo(tmp_path_factory.mktemp("separate"), **SEPARATE)


def test_colocated_and_separate_generation_give_the_same_result(
    ray_session, tmp_path, separate_generation_run
):
    colocated = run_grpo(
        tmp_path / "colocated", **{"grpo.max_num_steps": 2, "checkpointing.enabled": "false"}
    )
    separate = separate_generation_run
    for step in (1, 2):
        assert separate[step]["train/loss"] == pytest.approx(colocated[step]["train/loss"], abs=1e-6)
        assert separate[step]["train/reward_mean"] == pytest.approx(
            colocated[step]["train/reward_mean"], abs=1e-6
        )


class ScriptedGeneration:
    """Answers turn t of active sample i with script[t][i] (tests the rollout loop, not a model)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.turn = tokenizer, script, 0

    def generate(self, data, greedy=False, seed=None):
        texts = self.script[self.turn]
        self.turn += 1
        answers = [
            self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            for t in texts
        ]
        lengths = data["input_lengths"]
        width = int(lengths.max()) + max(len(a) for a in answers)
        output = torch.zeros(len(answers), width, dtype=torch.long)
        for i, ids in enumerate(answers):
            output[i, : lengths[i]] = data["input_ids"][i, : lengths[i]]
            output[i, lengths[i] : lengths[i] + len(ids)] = torch.tensor(ids)
        return {
            "output_ids": output,
            "logprobs": torch.full((len(answers), width), -0.5),
            "generation_lengths": torch.tensor([len(a) for a in answers]),
        }


def puzzle_records(tokenizer):
    from posttrain.data import DataConfig, load_datasets

    cfg = DataConfig(
        dataset="sliding_puzzle",
        format="rl",
        num_train=2,
        num_val=1,
        puzzle_size=2,
        puzzle_scramble_moves=1,
        max_length=512,
    )
    return load_datasets(cfg, tokenizer)[0]


def jump_then_solve(records) -> list[list[str]]:
    """A scripted policy for boards one move from solved: an invalid move, then the solving one (the
    blank must end bottom right)."""
    boards = [r["extra_env_info"]["board"] for r in records]
    blank_rows = [next(r for r, row in enumerate(b) if 0 in row) for b in boards]
    solving = ["down" if row == 0 else "right" for row in blank_rows]
    return [["<action>jump</action>"] * 2, [f"<action>{move}</action>" for move in solving]]


def test_multi_turn_puzzle_rollout_appends_observations_and_rewards_a_solve(ray_session):
    tokenizer = build_char_tokenizer()
    records = puzzle_records(tokenizer)  # boards one move from solved
    envs = create_environments(
        {"sliding_puzzle": EnvironmentConfig(cls="sliding_puzzle", kwargs={"max_moves": 3})}
    )
    script = jump_then_solve(records)
    rollouts, metrics = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, script),
        records_to_rollout_batch(records),
        tokenizer,
        envs,
        max_seq_len=512,
        max_rollout_turns=4,
    )
    assert rollouts["total_reward"].tolist() == [1.0, 1.0]
    assert rollouts["num_turns"].tolist() == [2, 2]
    log = rollouts["message_log"][0]
    assert [m["role"] for m in log] == ["user", "assistant", "environment", "assistant"]
    assert "Invalid move 'jump'" in log[2]["content"]
    assert metrics["termination_rate"] == 1.0 and metrics["truncation_rate"] == 0.0


def test_the_same_rollout_through_the_environment_service_on_loopback(ray_session):
    """The puzzle served over HTTP by a server this test starts on 127.0.0.1, played by the run's
    environment actors through `env.<task>.cls: remote`: the same rewards and turns as in process, and
    every episode is closed on the server at its end."""
    import threading

    from posttrain.environments.server import EnvironmentServer
    from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment

    server = EnvironmentServer(SlidingPuzzleEnvironment(max_moves=3))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tokenizer = build_char_tokenizer()
        records = puzzle_records(tokenizer)
        envs = create_environments(
            {"sliding_puzzle": EnvironmentConfig(cls="remote", kwargs={"url": server.url, "timeout_s": 10.0})}
        )
        script = jump_then_solve(records)
        rollouts, metrics = run_multi_turn_rollout(
            ScriptedGeneration(tokenizer, script),
            records_to_rollout_batch(records),
            tokenizer,
            envs,
            max_seq_len=512,
            max_rollout_turns=4,
        )
        assert rollouts["total_reward"].tolist() == [1.0, 1.0] and rollouts["num_turns"].tolist() == [2, 2]
        assert "Invalid move 'jump'" in rollouts["message_log"][0][2]["content"]
        assert len(server.episodes) == 0
        for env in envs.values():
            env.shutdown()
    finally:
        server.shutdown()
        server.server_close()


def test_a_rollout_that_would_exceed_max_seq_len_is_truncated(ray_session):
    tokenizer = build_char_tokenizer()
    records = puzzle_records(tokenizer)
    envs = create_environments({"sliding_puzzle": EnvironmentConfig(cls="sliding_puzzle")})
    prompt_length = max(r["length"] for r in records)
    rollouts, metrics = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, [["<action>jump</action>"] * 2] * 4),
        records_to_rollout_batch(records),
        tokenizer,
        envs,
        max_seq_len=prompt_length + 10,
        max_rollout_turns=4,
    )
    assert rollouts["truncated"].tolist() == [True, True] and metrics["truncation_rate"] == 1.0
    for log in rollouts["message_log"]:
        assert sum(len(m["token_ids"]) for m in log) <= prompt_length + 10


def test_dynamic_sampling_generates_more_rounds_and_fills_a_short_step(ray_session, tmp_path):
    """Exact match on an untrained model: every group has reward 0 (no signal), so all 3 rounds run and
    the step is filled with zero-signal groups; with the share-of-digits reward, extra rounds find enough
    groups with signal to fill the step."""
    settings = {
        "grpo.max_num_steps": 1,
        "checkpointing.enabled": "false",
        "grpo.val_period": 0,
        "grpo.dynamic_sampling.enabled": "true",
        "grpo.dynamic_sampling.max_num_gen_batches": 3,
    }
    no_signal = run_grpo(tmp_path / "exact", **settings, **{"env.arithmetic.cls": "exact_match"})[1]
    assert no_signal["train/rollout/num_generation_rounds"] == 3.0
    assert no_signal["train/rollout/dynamic_sampling/filled_without_signal"] == 16.0
    assert no_signal["train/advantage_abs_mean"] == 0.0
    signal = run_grpo(tmp_path / "digits", **settings)[1]
    assert signal["train/rollout/dynamic_sampling/samples_with_signal"] == 16.0
    assert signal["train/rollout/dynamic_sampling/filled_without_signal"] == 0.0
    assert signal["train/advantage_abs_mean"] > 0.0


def test_a_generation_worker_lost_mid_generate_costs_only_its_prompts(
    ray_session, tmp_path, monkeypatch, capsys, separate_generation_run
):
    """SEPARATE's run again, but rank 1 of the generation workers (samples 8-15) dies in its generate
    call of step 2, after the first refit. The handle starts a replacement with the policy's current
    weights and generates those samples again: the run finishes without a whole-run restart, and both
    steps' losses, mean rewards and the validation after step 2 equal those of the run without the loss."""
    from lost_generation_worker import dies_once_worker

    from posttrain.algorithms.recovery import train_with_restarts
    from posttrain.workers.generation import HFGeneration

    died = tmp_path / "died"
    monkeypatch.setattr(HFGeneration, "worker_cls", dies_once_worker(died, on_call=2))
    cfg = load_typed_config(
        grpo.GRPOConfig, CONFIG, overrides(tmp_path / "lost", **SEPARATE, **{"cluster.max_restarts": 1})
    )
    run, _ = train_with_restarts(cfg, grpo.setup, grpo.grpo_train)
    assert died.exists() and run.step == 2 and run.generation.num_worker_restarts == 1
    out = capsys.readouterr().out
    assert "generation: lost worker(s) hf_generation-1-" in out and "(generation restart 1 of 1)" in out
    assert "generating samples again: [8, 16) on rank 1" in out
    assert "from the latest checkpoint" not in out  # no whole-run restart
    lost, reference = metrics_by_step(tmp_path / "lost"), separate_generation_run
    for step in (1, 2):
        for key in ("train/loss", "train/reward_mean"):
            assert lost[step][key] == pytest.approx(reference[step][key], abs=1e-6), (key, step)
    assert lost[2]["val/accuracy"] == reference[2]["val/accuracy"]
    assert reference[2]["train/loss"] != 0.0
