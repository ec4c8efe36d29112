"""Context parallelism on real Ray workers over gloo: a batch whose sequences are split over 2 CP ranks
(and packed rows on 2 data-parallel x 2 CP ranks) gives the logprobs, SFT and GRPO losses, gradient norms
and weights of one worker; SFT from configs/sft_long_cp_tiny.yaml (~1,500-token rows) gives one worker's
losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import sft
from posttrain.algorithms.loss import ClippedPGLoss, NLLLoss
from posttrain.config import load_typed_config, validate_config
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.handle import Policy

pytestmark = pytest.mark.slow  # multi-worker runs: make test, not make test-fast

NUM_ROWS, SEQ_LEN = 8, 26
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def make_data() -> BatchedDataDict:
    """Right-padded random rows of lengths 9..26, trained on every real token after a 4-token prompt;
    row 3 masked out."""
    generator = torch.Generator().manual_seed(1)
    input_lengths = torch.randint(9, SEQ_LEN + 1, (NUM_ROWS,), generator=generator)  # [B]
    real = torch.arange(SEQ_LEN).unsqueeze(0) < input_lengths.unsqueeze(1)  # [B, T]
    input_ids = torch.randint(4, 100, (NUM_ROWS, SEQ_LEN), generator=generator) * real
    token_mask = real.long()
    token_mask[:, :4] = 0
    sample_mask = torch.ones(NUM_ROWS)
    sample_mask[3] = 0.0
    return BatchedDataDict(
        input_ids=input_ids, input_lengths=input_lengths, token_mask=token_mask, sample_mask=sample_mask
    )


class Trained:
    """A policy on its own cluster after: logprobs, two SFT steps, then two GRPO (clipped policy-gradient)
    steps on seeded advantages with the policy's logprobs as prev_logprobs; keeps what the tests compare."""

    def __init__(self, model_dir, num_workers: int, **overrides):
        self.cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
        cfg = dict(
            model_name=str(model_dir),
            train_global_batch_size=NUM_ROWS,
            train_micro_batch_size=2,
            logprob_batch_size=3,
            max_grad_norm=0.5,
            optimizer={"name": "SGD", "kwargs": {"lr": 0.5}},
            seed=0,
            **overrides,
        )
        self.policy = Policy(self.cluster, validate_config(PolicyConfig, cfg))

    def train(self, ray_session) -> Trained:
        data = make_data()
        self.initial_logprobs = self.policy.get_logprobs(data)["logprobs"]
        steps = [self.policy.train(data, NLLLoss()) for _ in range(2)]
        rows = BatchedDataDict(dict(data))
        rows["advantages"] = torch.randn(data["input_ids"].shape, generator=torch.Generator().manual_seed(2))
        rows["prev_logprobs"] = self.policy.get_logprobs(data)["logprobs"]
        steps += [self.policy.train(rows, ClippedPGLoss()) for _ in range(2)]
        self.losses = [step["loss"][0] for step in steps]
        self.grad_norms = [step["grad_norm"][0] for step in steps]
        self.weights = ray_session.get(self.policy.get_weights(only_changed=False))
        return self

    def shutdown(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with grouped-query attention (4 heads, 2 key/value heads) and tied embeddings."""
    cfg = ModelFromConfig(
        architecture="llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_llama"))


LAYOUTS = {  # name -> (workers, policy overrides)
    "one_worker": (1, {}),
    "cp2": (2, {"context_parallel_size": 2}),
    "dp2_cp2_packed": (
        4,
        {"context_parallel_size": 2, "sequence_packing": {"enabled": True, "max_tokens_per_bin": 48}},
    ),
}


@pytest.fixture(scope="module")
def runs(ray_session, model_dir):
    """Every layout's workers start together (their start-up overlaps), then each trains."""
    built = {}
    try:
        for name, (workers, overrides) in LAYOUTS.items():
            built[name] = Trained(model_dir, workers, **overrides)
        yield {name: run.train(ray_session) for name, run in built.items()}
    finally:
        for run in built.values():
            run.shutdown()


@pytest.mark.parametrize("layout", ["cp2", "dp2_cp2_packed"])
def test_context_parallel_equals_one_worker(runs, layout):
    """Logprobs, the two SFT and two GRPO losses and gradient norms, and every weight after the four steps
    (AdamW at lr 1e-2, so a wrong gradient moves weights by ~1e-2) equal one worker's within 1e-5."""
    baseline, run = runs["one_worker"], runs[layout]
    torch.testing.assert_close(run.initial_logprobs, baseline.initial_logprobs, atol=1e-5, rtol=0)
    assert baseline.losses[1] < baseline.losses[0]  # the SFT step learned something to compare
    assert run.losses == pytest.approx(baseline.losses, abs=1e-5)
    assert run.grad_norms == pytest.approx(baseline.grad_norms, abs=1e-5)
    assert run.weights.keys() == baseline.weights.keys()
    differences = {name: float((run.weights[name] - w).abs().max()) for name, w in baseline.weights.items()}
    assert max(differences.values()) <= 1e-5, differences


def test_topk_logprobs_under_context_parallelism_is_a_clear_error(runs):
    data = make_data()
    with pytest.raises(Exception, match=r"policy.context_parallel_size > 1: top-k logprobs"):
        runs["cp2"].policy.get_topk_logprobs(data, 2)


def run_long_sft(log_dir, **extra) -> dict[int, float]:
    """Two steps of configs/sft_long_cp_tiny.yaml (its ~1,500-token rows kept; 4 rows a step, one micro-batch
    of 2 per data-parallel rank) and a validation on 8 rows at step 2; the train loss by step."""
    values = {
        "logger.log_dir": str(log_dir),
        "sft.max_num_steps": 2,
        "sft.val_period": 2,
        "sft.max_val_samples": 8,
        "sft.val_global_batch_size": 8,
        "sft.export_final_model": "false",
        "policy.train_global_batch_size": 4,
        "policy.train_micro_batch_size": 2,
        "data.num_train": 64,
        "data.num_val": 8,
        "checkpointing.enabled": "false",
        "cluster.num_cpus_per_worker": 0.5,
        **extra,
    }
    overrides = [f"{key}={value}" for key, value in values.items()]
    run = sft.setup(load_typed_config(sft.SFTConfig, str(CONFIGS / "sft_long_cp_tiny.yaml"), overrides))
    try:
        sft.sft_train(run)
    finally:
        run.shutdown()
    records = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return {record["step"]: record["train/loss"] for record in records if "train/loss" in record}


def test_sft_from_the_long_sequence_config_through_context_parallelism_equals_one_worker(
    ray_session, tmp_path
):
    """configs/sft_long_cp_tiny.yaml as shipped (context_parallel_size 2 on 2 workers) and on 1 worker
    without CP: the same train losses of both steps and the same validation loss, within 1e-5."""
    split = run_long_sft(tmp_path / "cp2")
    one = run_long_sft(tmp_path / "one", **{"cluster.workers_per_node": 1, "policy.context_parallel_size": 1})
    assert list(one) == [1, 2]
    assert one[1] > 4.0  # an untrained model: about the log of the 105-token vocabulary
    assert [split[step] for step in one] == pytest.approx(list(one.values()), abs=1e-5)
    assert len(val_losses(tmp_path / "one")) == 1  # the validation at step 2
    assert val_losses(tmp_path / "cp2") == pytest.approx(val_losses(tmp_path / "one"), abs=1e-5)


def val_losses(log_dir) -> list[float]:
    records = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return [record["val/loss"] for record in records if "val/loss" in record]
