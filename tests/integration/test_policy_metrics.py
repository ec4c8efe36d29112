"""Metric reductions named per metric by the loss function, across micro-batches and two real policy
workers (FSDP2 over gloo)."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import Loss, NLLLoss
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.handle import Policy

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

LENGTHS = [5, 9, 7, 12, 6, 8, 11, 10]  # 8 rows: 2 workers x 2 micro-batches of 2 rows


class LengthStatsLoss(Loss):
    """NLL plus three statistics of each micro-batch's row lengths, reduced as declared: names without a
    `_min` / `_max` suffix, so a suffix rule alone would sum all three."""

    metric_reductions = {"length_mean": "mean", "longest": "max", "shortest": "min"}

    def __call__(self, logprobs, data, global_valid_seqs, global_valid_toks):
        loss, metrics = NLLLoss()(logprobs, data, global_valid_seqs, global_valid_toks)
        lengths = data["input_lengths"].float()
        return loss, metrics | {
            "length_mean": float(lengths.mean()),
            "longest": float(lengths.max()),
            "shortest": float(lengths.min()),
        }


@pytest.fixture(scope="module")
def two_workers(ray_session, tmp_path_factory):
    model_cfg = ModelFromConfig(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64)
    model_dir = build_model_dir(model_cfg, tmp_path_factory.mktemp("tiny"))
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    policy = Policy(
        cluster,
        PolicyConfig(
            model_name=str(model_dir),
            train_global_batch_size=8,
            train_micro_batch_size=2,
            logprob_batch_size=4,
        ),
    )
    yield policy
    policy.shutdown()
    cluster.shutdown()


def length_data() -> BatchedDataDict:
    lengths = torch.tensor(LENGTHS)
    real = (torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [8, 12]
    return BatchedDataDict(
        input_ids=(torch.arange(12) % 50 + 4) * real, input_lengths=lengths, token_mask=real
    )


def test_metric_reductions_across_ranks_are_chosen_per_metric(two_workers):
    """ "Tracking distributed metrics with specified reductions (mean, max, etc.)": over the 4 micro-batches
    of 2 rows on 2 ranks, the mean of micro-batch means is the mean of all 8 lengths (68/8 = 8.5), the
    max is 12 and the min is 5 -- not their sums (34, 41, 25)."""
    metrics = two_workers.evaluate(length_data(), LengthStatsLoss())
    assert metrics["length_mean"] == [8.5]
    assert metrics["longest"] == [12.0]
    assert metrics["shortest"] == [5.0]
    assert metrics["num_valid_tokens"] == [68.0]  # undeclared: summed
