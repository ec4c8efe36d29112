"""`posttrain eval` end to end on real Ray actors: the CLI on the built-in arithmetic task (files, counts,
pass@k and cons@k from the written rewards), and a GRPO run's checkpoint directory evaluated directly,
which gives the same samples, accuracy and pass@k as that run's own validation with the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.algorithms import grpo
from posttrain.algorithms.grpo import GRPOConfig, GRPOLoopConfig
from posttrain.algorithms.loss import ClippedPGLossConfig
from posttrain.data import DataConfig
from posttrain.distributed.virtual_cluster import ClusterConfig
from posttrain.evals import eval_cons_k, eval_pass_k
from posttrain.evals.run import EvalConfig, EvalModelConfig, EvalSettings, run_eval
from posttrain.evals.validate import SamplingSettings
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.utils.checkpoint import CheckpointingConfig
from posttrain.utils.logger import LoggerConfig
from posttrain.workers.generation import GenerationConfig
from posttrain.workers.policy import OptimizerConfig, PolicyConfig

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "eval_tiny.yaml"
NUM_VAL = 8  # validation prompts of the GRPO / eval comparison
MAX_SEQ_LEN = 48
# Untied embeddings: a tied random model's greedy output just repeats the last prompt token.
TINY = ModelFromConfig(
    hidden_size=32,
    num_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    seed=4,
    tie_word_embeddings=False,
)
VAL_SEED = 7


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def arithmetic_data() -> DataConfig:
    return DataConfig(dataset="arithmetic", format="rl", num_train=64, num_val=NUM_VAL, seed=5)


def small_generation() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=6, num_cpus_per_worker=0.5)


def test_cli_eval_writes_summary_and_samples_whose_rewards_give_the_score(ray_session, tmp_path):
    save_path = tmp_path / "eval"
    code = cli.main(
        [
            "eval",
            "--config",
            str(CONFIG),
            f"eval.save_path={save_path}",
            "eval.max_samples=6",
            "eval.batch_size=4",
        ]
    )
    assert code == 0
    summary = json.loads((save_path / "summary.json").read_text())
    samples = read_jsonl(save_path / "samples.jsonl")
    n, k = summary["num_tests_per_prompt"], summary["k"]
    assert (summary["metric"], n, k) == ("pass@2", 4, 2)
    assert summary["num_prompts"] == 6 and summary["num_samples"] == len(samples) == 6 * n
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [
        (i // n, i % n) for i in range(6 * n)
    ]
    for prompt_index in range(6):  # each prompt's n samples are contiguous and share the prompt
        assert len({s["prompt"] for s in samples[prompt_index * n : (prompt_index + 1) * n]}) == 1
    assert {"prompt", "response", "reward", "extracted_answer", "ground_truth"} <= set(samples[0])
    rewards = [s["reward"] for s in samples]
    assert summary["score"] == eval_pass_k(rewards, n, k)
    assert summary["accuracy"] == pytest.approx(sum(rewards) / len(rewards))
    grades = [s["strict_grade"] for s in samples]  # final_number: every arithmetic answer is a number
    assert summary["grader"] == "final_number" and summary["num_strict_graded"] == len(samples)
    assert set(grades) <= {0.0, 1.0}
    assert summary["strict_accuracy"] == pytest.approx(sum(grades) / len(grades))
    assert (save_path / "config.yaml").is_file()
    assert not list(save_path.glob(".model-*"))  # the temporary model directory is removed

    code = cli.main(
        [
            "eval",
            "--config",
            str(CONFIG),
            f"eval.save_path={save_path}",
            "eval.max_samples=6",
            "eval.batch_size=4",
            "eval.metric=cons@k",
        ]
    )
    cons = json.loads((save_path / "summary.json").read_text())
    cons_samples = read_jsonl(save_path / "samples.jsonl")
    assert [s["response"] for s in cons_samples] == [
        s["response"] for s in samples
    ]  # same seed, same samples
    answers = [(s["extracted_answer"] or "").strip() or None for s in cons_samples]
    assert cons["score"] == eval_cons_k(rewards, n, k, answers, seed=cons["seed"])


def test_cli_eval_rejects_greedy_with_several_samples_before_starting(tmp_path, capsys):
    code = cli.main(["eval", "--config", str(CONFIG), f"eval.save_path={tmp_path / 'x'}", "eval.greedy=true"])
    assert code == 2
    assert "eval.greedy" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def grpo_run_dir(ray_session, tmp_path_factory) -> Path:
    """One GRPO step on a tiny model, validated (2 samples per prompt) at steps 0 and 1, checkpointed at 1.

    An untrained model earns no reward, so the advantages and gradients are 0; AdamW's decoupled weight
    decay (lr 0.05 x 4 = 20% shrink) still changes the weights, so step 1 samples differently from step 0.
    """
    root = tmp_path_factory.mktemp("grpo")
    model_dir = build_model_dir(TINY, root / "initial_model")
    cfg = GRPOConfig(
        grpo=GRPOLoopConfig(
            num_prompts_per_step=4,
            num_generations_per_prompt=2,
            max_num_steps=1,
            val_period=1,
            val_at_start=True,
            max_val_samples=NUM_VAL,
            validation=SamplingSettings(num_tests_per_prompt=2, k_value=2, greedy=False),
            max_seq_len=MAX_SEQ_LEN,
            seed=VAL_SEED,
        ),
        loss=ClippedPGLossConfig(),
        policy=PolicyConfig(
            model_name=str(model_dir),
            train_global_batch_size=8,
            train_micro_batch_size=4,
            optimizer=OptimizerConfig(name="AdamW", kwargs={"lr": 0.05, "weight_decay": 4.0}),
        ),
        generation=small_generation(),
        data=arithmetic_data(),
        cluster=ClusterConfig(num_cpus_per_worker=0.5),
        logger=LoggerConfig(log_dir=str(root / "run"), tensorboard_enabled=False),
        checkpointing=CheckpointingConfig(
            checkpoint_dir="", metric_name="val_accuracy", higher_is_better=True, save_period=1
        ),
    )
    run = grpo.setup(cfg)
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    return root / "run"


def test_eval_of_a_grpo_checkpoint_matches_the_runs_own_validation(grpo_run_dir, tmp_path):
    checkpoint = grpo_run_dir / "checkpoints" / "step_1"
    cfg = EvalConfig(
        eval=EvalSettings(
            metric="pass@k",
            k_value=2,
            num_tests_per_prompt=2,
            greedy=False,
            seed=VAL_SEED,
            max_samples=NUM_VAL,
            max_seq_len=MAX_SEQ_LEN,
            save_path=str(tmp_path),
        ),
        model=EvalModelConfig(model_name=str(checkpoint)),
        generation=small_generation(),
        data=arithmetic_data(),
        cluster=ClusterConfig(num_cpus_per_worker=0.5),
    )
    result = run_eval(cfg)
    responses = [s["response"] for s in result.samples]
    step0 = read_jsonl(grpo_run_dir / "val_samples" / "step_0.jsonl")
    step1 = read_jsonl(grpo_run_dir / "val_samples" / "step_1.jsonl")
    assert responses != [s["response"] for s in step0]  # the comparison tells the checkpoint from the start
    assert responses == [s["response"] for s in step1]
    assert [s["reward"] for s in result.samples] == [s["reward"] for s in step1]
    val = [
        row
        for row in read_jsonl(grpo_run_dir / "metrics.jsonl")
        if row["step"] == 1 and "val/accuracy" in row
    ]
    assert result.summary["accuracy"] == pytest.approx(val[0]["val/accuracy"], abs=1e-7)
    assert result.summary["score"] == pytest.approx(val[0]["val/pass@2"], abs=1e-7)
    assert result.summary["strict_accuracy"] == pytest.approx(val[0]["val/strict_accuracy"], abs=1e-7)
    logged = read_jsonl(tmp_path / "metrics.jsonl")  # the eval's own logger: at the checkpoint's step
    assert [(row["step"], row["eval/score"]) for row in logged] == [(1, result.summary["score"])]
