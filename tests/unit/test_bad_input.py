"""Bad input stops a run early with an error naming the culprit: the config key (and its file), or the
data file and line. One test per kind of bad input; none of them starts Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.algorithms import dpo, grpo, pairs, sft
from posttrain.config import ConfigError, load_typed_config
from posttrain.data import DataConfig, DataError, load_datasets
from posttrain.distributed import virtual_cluster
from posttrain.distributed.virtual_cluster import (
    ClusterConfig,
    ClusterConnectionError,
    check_reachable,
    init_ray,
)
from posttrain.models.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SFT_TINY = str(CONFIGS / "sft_tiny.yaml")
TOKENIZER = build_char_tokenizer()


def sft_config(*overrides: str):
    return load_typed_config(sft.SFTConfig, SFT_TINY, list(overrides))


def config_error(schema, path: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_typed_config(schema, path, list(overrides))
    return str(caught.value)


@pytest.fixture
def no_ray(monkeypatch):
    """These checks run before Ray: make sure a Ray instance left by other tests does not change them."""
    monkeypatch.setattr(virtual_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# -- loop lengths --------------------------------------------------------------------------------------


def test_max_num_steps_zero_is_an_error_not_a_full_run():
    assert config_error(sft.SFTConfig, SFT_TINY, "sft.max_num_steps=0") == (
        "sft.max_num_steps: must be >= 1 (or null where epochs decide), got 0 (from command line)"
    )


def test_negative_max_num_steps_is_an_error():
    message = config_error(grpo.GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), "grpo.max_num_steps=-3")
    assert message.startswith("grpo.max_num_steps: must be >= 1") and "got -3" in message


def test_max_num_epochs_zero_is_an_error():
    assert config_error(sft.SFTConfig, SFT_TINY, "sft.max_num_epochs=0") == (
        "sft.max_num_epochs: must be >= 1, got 0 (from command line)"
    )


@pytest.mark.parametrize("value", ["0", "-4"])
def test_val_global_batch_size_below_one_is_an_error(value):
    message = config_error(
        dpo.DPOConfig, str(CONFIGS / "dpo_tiny.yaml"), f"dpo.val_global_batch_size={value}"
    )
    assert message == f"dpo.val_global_batch_size: must be >= 1, got {value} (from command line)"


def test_renamed_keys_answer_with_their_replacement(tmp_path):
    """From the command line and from a file, in GRPO's section and the supervised loops' sections."""
    grpo_tiny = str(CONFIGS / "grpo_tiny.yaml")
    for old, new in (
        ("val_num_generations", "num_tests_per_prompt"),
        ("val_pass_k", "k_value"),
        ("val_greedy", "greedy"),
        ("val_pass_threshold", "pass_threshold"),
        ("val_grader", "grader"),
    ):
        assert config_error(grpo.GRPOConfig, grpo_tiny, f"grpo.{old}=1") == (
            f"grpo.{old}: renamed: use grpo.validation.{new} (from command line)"
        )
    assert config_error(sft.SFTConfig, SFT_TINY, "sft.val_max_samples=8") == (
        "sft.val_max_samples: renamed: use sft.max_val_samples (from command line)"
    )
    path = tmp_path / "old.yaml"
    path.write_text(f"defaults: {CONFIGS / 'dpo_tiny.yaml'}\ndpo:\n  val_max_samples: 8\n")
    assert config_error(dpo.DPOConfig, str(path)) == (
        f"dpo.val_max_samples: renamed: use dpo.max_val_samples (from {path})"
    )


def test_grpo_validation_and_eval_share_one_sampling_rule():
    """The same keys, defaults and messages in `grpo.validation` and `eval`; val_period 0 (never) is valid
    in every loop."""
    from posttrain.evals.run import EvalConfig

    grpo_tiny, eval_tiny = str(CONFIGS / "grpo_tiny.yaml"), str(CONFIGS / "eval_tiny.yaml")
    message = (
        "greedy decoding gives num_tests_per_prompt=4 identical samples; set greedy=false to sample, or "
    )
    message += "num_tests_per_prompt=1"
    assert config_error(grpo.GRPOConfig, grpo_tiny, "grpo.validation.num_tests_per_prompt=4") == (
        f"grpo.validation.greedy: {message}"
    )
    assert (
        config_error(EvalConfig, eval_tiny, "eval.greedy=true", "eval.k_value=1")
        == f"eval.greedy: {message} (from command line)"
    )
    for section, schema, path in (
        ("grpo.validation", grpo.GRPOConfig, grpo_tiny),
        ("eval", EvalConfig, eval_tiny),
    ):
        n = f"{section}.num_tests_per_prompt=2"
        assert config_error(schema, path, f"{section}.k_value=3", f"{section}.greedy=false", n) == (
            f"{section}.num_tests_per_prompt: must be >= k_value=3, got 2 (from command line)"
        )
    assert sft_config("sft.val_period=0").sft.val_period == 0
    assert "must be >= 0 (0: never), got -1" in config_error(sft.SFTConfig, SFT_TINY, "sft.val_period=-1")


# -- cluster -------------------------------------------------------------------------------------------


def test_more_workers_than_the_machines_cpus_is_an_error_for_a_local_cluster(no_ray):
    workers = (os.cpu_count() or 1) + 1
    message = config_error(sft.SFTConfig, SFT_TINY, f"cluster.workers_per_node={workers}")
    assert message.startswith(
        f"cluster.workers_per_node: 1 x {workers} workers x 1 CPUs = {workers} CPUs, but"
    )
    assert "cluster.num_cpus to oversubscribe" in message
    assert (
        sft_config(f"cluster.workers_per_node={workers}", f"cluster.num_cpus={workers}").cluster.num_cpus
        == workers
    )


def test_negative_cpus_per_worker_is_an_error():
    assert config_error(sft.SFTConfig, SFT_TINY, "cluster.num_cpus_per_worker=-1") == (
        "cluster.num_cpus_per_worker: must be >= 0, got -1.0 (from command line)"
    )


def test_tensor_parallel_size_that_does_not_divide_the_workers_is_an_error():
    message = config_error(
        sft.SFTConfig,
        SFT_TINY,
        "policy.tensor_parallel_size=3",
        "cluster.workers_per_node=2",
        "cluster.num_cpus=4",
    )
    assert message == (
        "policy.tensor_parallel_size: 3 does not divide the 2 workers (cluster.num_nodes x "
        "cluster.workers_per_node) (from command line)"
    )


def test_unreachable_cluster_address_fails_within_seconds(no_ray):
    start = time.monotonic()
    with pytest.raises(
        ClusterConnectionError, match=r"cluster.address='127.0.0.1:1': nothing answers at 127.0.0.1:1"
    ):
        init_ray(ClusterConfig(address="127.0.0.1:1", connect_timeout_s=2.0))
    with pytest.raises(ClusterConnectionError, match=r"cluster.address='ray://127.0.0.1:1': nothing answers"):
        check_reachable("ray://127.0.0.1:1", timeout_s=1.0)
    assert time.monotonic() - start < 5.0


# -- optimizer and scheduler ---------------------------------------------------------------------------


def test_unknown_optimizer_name_is_caught_on_the_driver():
    message = config_error(sft.SFTConfig, SFT_TINY, "policy.optimizer.name=AdamX")
    assert message.startswith(
        "policy.optimizer.name: torch.optim has no Optimizer named 'AdamX'; did you mean 'Adam"
    )


def test_unknown_optimizer_kwarg_is_caught_on_the_driver():
    message = config_error(sft.SFTConfig, SFT_TINY, "+policy.optimizer.kwargs.momentum=0.9")
    assert (
        message.startswith("policy.optimizer.kwargs: AdamW(**{")
        and "unexpected keyword argument 'momentum'" in message
    )


def test_unknown_scheduler_name_and_kwarg_are_caught_on_the_driver(tmp_path):
    path = tmp_path / "sched.yaml"
    path.write_text(
        f"defaults: {SFT_TINY}\npolicy:\n  scheduler:\n    - name: LinearLRR\n      kwargs: {{}}\n"
    )
    assert config_error(sft.SFTConfig, str(path)).startswith(
        "policy.scheduler[0].name: torch.optim.lr_scheduler has no LRScheduler named 'LinearLRR'; did you "
        "mean 'LinearLR'?"
    )
    path.write_text(
        f"defaults: {SFT_TINY}\npolicy:\n  scheduler:\n    - name: LinearLR\n      kwargs: {{steps: 3}}\n"
    )
    assert "unexpected keyword argument 'steps'" in config_error(sft.SFTConfig, str(path))


# -- paths and names -----------------------------------------------------------------------------------


def test_missing_model_of_a_tiny_config_names_the_key_and_the_command_that_makes_it(tmp_path, monkeypatch):
    shutil.copytree(CONFIGS, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)  # a fresh clone: no results/ yet
    cfg = load_typed_config(dpo.DPOConfig, "configs/dpo_tiny.yaml", [f"logger.log_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as caught:
        pairs.setup(cfg)
    assert str(caught.value) == (
        "policy.model_name: results/sft_tiny/hf_model does not exist (nor is it a Hugging "
        "Face hub name); `posttrain sft --config configs/sft_tiny.yaml` writes it"
    )


def test_missing_critic_and_teacher_models_are_named_when_the_config_loads(tmp_path):
    """The helper model the estimator uses is checked with the policy's, before a cluster starts; the other
    estimators' helper sections are not looked at (grpo_tiny's policy model is not built in this test)."""
    typo = str(tmp_path / "no_such_model")
    grpo_tiny = str(CONFIGS / "grpo_tiny.yaml")
    for estimator, key in (
        ("gae", "critic.model.model_name"),
        ("on_policy_distillation", "teacher.model.model_name"),
    ):
        cfg = load_typed_config(
            grpo.GRPOConfig, grpo_tiny, [f"grpo.advantage_estimator={estimator}", f"{key}={typo}"]
        )
        problems = [str(problem).split(" does not exist")[0] for problem in cfg.missing_files()]
        assert problems[1:] == [f"{key}: {typo}"] and problems[0].startswith("policy.model_name: ")
    cfg = load_typed_config(grpo.GRPOConfig, grpo_tiny, [f"teacher.model.model_name={typo}"])
    assert [str(problem).split(":")[0] for problem in cfg.missing_files()] == ["policy.model_name"]


def test_an_agent_command_is_checked_when_the_config_loads():
    grpo_tiny = str(CONFIGS / "grpo_tiny.yaml")
    both = "env.arithmetic={_override_: true, agent: 'a.py:fn', agent_command: [python, a.py]}"
    assert config_error(grpo.GRPOConfig, grpo_tiny, both) == (
        "env.arithmetic.agent_command: an agent is a function (agent) or a command: set one of them "
        "(from command line)"
    )
    missing = "env.arithmetic={_override_: true, agent_command: [no-such-agent-binary, --fast]}"
    cfg = load_typed_config(grpo.GRPOConfig, grpo_tiny, [missing])
    assert "env.arithmetic.agent_command: no-such-agent-binary is not found" in map(str, cfg.missing_files())


def test_dataset_name_typo_is_a_config_error_not_a_hub_lookup():
    assert config_error(sft.SFTConfig, SFT_TINY, "data.dataset=arithmetc") == (
        "data.dataset: 'arithmetc' is not a built-in task (arithmetic, arithmetic_preference, "
        "sliding_puzzle, math_words, math_steps, multiplication, red_squares, constrained_lists), a "
        ".jsonl/.json/.parquet/.csv file, a Hugging Face dataset name (org/name) or reasoning_gym:<task>; "
        "did you mean "
        "'arithmetic'? "
        "(from command line)"
    )
    assert (
        sft_config("data.dataset=openai/gsm8k").data.dataset == "openai/gsm8k"
    )  # plausible: left to the hub


def test_resume_from_that_does_not_exist_is_an_error_before_any_worker(tmp_path):
    cfg = sft_config(
        f"logger.log_dir={tmp_path}", f"checkpointing.resume_from={tmp_path / 'nope' / 'step_9'}"
    )
    with pytest.raises(ConfigError, match=r"^checkpointing.resume_from: .*nope/step_9 does not exist"):
        sft.setup(cfg)


def test_global_batch_larger_than_the_data_is_an_error_before_any_worker(tmp_path):
    data = tmp_path / "small.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(20))
    )
    cfg = sft_config(
        f"logger.log_dir={tmp_path / 'run'}",
        f"data.dataset={data}",
        "data.val_fraction=0.1",
        "policy.train_global_batch_size=32",
    )
    with pytest.raises(ConfigError) as caught:
        sft.setup(cfg)
    assert str(caught.value) == (
        f"policy.train_global_batch_size: 32 needs 32 training records per step, but "
        f"data.dataset={data} has 18 usable ones"
    )


# -- data files ----------------------------------------------------------------------------------------


def write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_non_utf8_line_names_file_and_line_and_obeys_skip_invalid(tmp_path):
    good = json.dumps({"prompt": "a", "response": "b"}).encode()
    path = write_bytes(
        tmp_path / "latin1.jsonl", b"\n".join([good, '{"prompt": "caf\xe9"}'.encode("latin-1"), good])
    )
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(invalid continuation byte"):
        load_datasets(DataConfig(dataset=path, val_dataset=path), TOKENIZER)
    train, _, stats = load_datasets(DataConfig(dataset=path, val_dataset=path, skip_invalid=True), TOKENIZER)
    assert len(train) == 2 and stats["skipped_invalid"] == 2.0  # once for train, once for val
    csv_path = write_bytes(tmp_path / "latin1.csv", b"prompt,response\na,b\nc,caf\xe9\n")
    with pytest.raises(DataError, match=r"latin1.csv:3: not UTF-8"):
        load_datasets(DataConfig(dataset=csv_path, val_dataset=csv_path), TOKENIZER)


def test_byte_order_mark_is_accepted(tmp_path):
    bom = b"\xef\xbb\xbf"
    jsonl = write_bytes(
        tmp_path / "bom.jsonl", bom + json.dumps({"prompt": "a", "response": "b"}).encode() + b"\n"
    )
    csv_path = write_bytes(tmp_path / "bom.csv", bom + b"prompt,response\na,b\n")
    json_path = write_bytes(
        tmp_path / "bom.json", bom + json.dumps([{"prompt": "a", "response": "b"}]).encode()
    )
    for path in (jsonl, csv_path, json_path):
        train, _, _ = load_datasets(DataConfig(dataset=path, val_dataset=path), TOKENIZER)
        assert [m["content"] for m in train[0]["message_log"]] == ["a", "b"]


def test_csv_errors_name_the_file_line(tmp_path):
    text = 'prompt,response\na,b\n"multi\nline",c\nd,e,extra\nf,g\n'
    path = write_bytes(tmp_path / "rows.csv", text.encode())
    with pytest.raises(DataError, match=r"rows.csv:5: expected 2 fields \(prompt, response\), got 3"):
        load_datasets(DataConfig(dataset=path, val_dataset=path), TOKENIZER)
    missing = write_bytes(tmp_path / "missing.csv", b"prompt,response\na,b\nc,\n")
    train, _, _ = load_datasets(DataConfig(dataset=missing, val_dataset=missing), TOKENIZER)
    assert [m["content"] for m in train[1]["message_log"]] == ["c", ""]  # an empty field is an empty string
    bad = write_bytes(tmp_path / "bad.csv", b"question,reply\na,b\n")
    with pytest.raises(DataError, match=r"bad.csv:2: .*missing field 'prompt'"):
        load_datasets(DataConfig(dataset=bad, val_dataset=bad, format="prompt_response"), TOKENIZER)


def test_conversation_without_an_assistant_turn_is_an_error(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"chats.jsonl:2: 'messages' has no assistant turn"):
        load_datasets(DataConfig(dataset=str(path), val_dataset=str(path)), TOKENIZER)


BIG_ROW = """
import json, resource, sys
from posttrain.data import DataConfig, load_datasets
from posttrain.models.tokenizer import build_char_tokenizer
path = sys.argv[1]
with open(path, "w") as f:
    f.write(json.dumps({"prompt": "a", "response": "7" * 10_000_000}) + "\\n")
    f.write(json.dumps({"prompt": "a", "response": "b"}) + "\\n")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
train, _, stats = load_datasets(DataConfig(dataset=path, val_dataset=path, max_length=64),
build_char_tokenizer())
print(json.dumps({"growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "lengths": [r["length"] for r in train], "truncated": stats["truncated"]}))
"""


def test_a_10_mb_row_is_cut_before_tokenizing(tmp_path):
    """Measured before the fix: the driver's peak RSS grew by ~3.8 GB and loading took ~50 s."""
    out = subprocess.run(
        [sys.executable, "-c", BIG_ROW, str(tmp_path / "big.jsonl")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["lengths"] == [64, 5] and report["truncated"] == 2.0
    assert report["growth_mb"] < 300, report
