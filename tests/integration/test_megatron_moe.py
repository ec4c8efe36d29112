"""Mixture-of-experts models on the Megatron Core backend, on real Ray workers over gloo: a tiny Qwen3-MoE
converted to Megatron's MoE layers gives the DTensor backend's logprobs, losses and gradient norms (router
z-loss included); its experts split over 2 workers (EP 2) train like the same 2 workers each holding every
expert (EP 1) and export the same Hugging Face weights; an expert-parallel size that does not divide the
experts fails naming the key. Mixtral converts to Megatron and back with the HF logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # multi-worker Megatron runs: make test, not make test-fast

pytest.importorskip("megatron.core", reason="policy.backend=megatron needs posttrain[megatron]")

from transformers import AutoConfig  # noqa: E402

from posttrain.algorithms.loss import NLLLoss  # noqa: E402
from posttrain.config import ConfigError  # noqa: E402
from posttrain.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster  # noqa: E402
from posttrain.models.build import ModelFromConfig, build_model_dir  # noqa: E402
from posttrain.workers.policy.handle import Policy  # noqa: E402
from posttrain.workers.policy.megatron_moe_convert import check_moe_pipeline, moe_layout  # noqa: E402
from tests.integration.test_expert_parallel import SGD, TINY_MOE  # noqa: E402
from tests.integration.test_megatron import megatron_round_trip  # noqa: E402
from tests.integration.test_policy import (  # noqa: E402
    Run,
    assert_same_training,
    make_train_data,
    policy_config,
)

MOE_LOSSES = {"z_loss_coef": 0.01}  # the router z-loss, defined alike on both backends (see moe_rows)


def moe_rows() -> BatchedDataDict:
    """The test rows, trained on every real token of every row. The router losses of both backends cover
    a micro-batch's real tokens and weigh it by its share of them; the DTensor backend's share counts
    trained tokens, so with every real token trained the two z-losses are the same function."""
    data = make_train_data()
    lengths = data["input_lengths"]
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < lengths[:, None]).long()
    data["sample_mask"] = torch.ones(data.size)
    return data


def trained(model_dir, ray_session, num_workers: int, **overrides) -> Run:
    run = Run(model_dir, num_workers, optimizer=SGD, moe=MOE_LOSSES, **overrides)
    run.data = moe_rows()
    return run.train(ray_session)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_model_dir(TINY_MOE, tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="module")
def runs(ray_session, moe_dir, tmp_path_factory):
    """3 SGD steps (clipped to norm 0.5) of the DTensor backend on one worker and of the Megatron backend
    on two (data parallel; EP 1 and EP 2), each exported to a Hugging Face directory."""
    built = {
        "dtensor": trained(moe_dir, ray_session, 1),
        "ep1": trained(moe_dir, ray_session, 2, backend="megatron"),
        "ep2": trained(moe_dir, ray_session, 2, backend="megatron", expert_parallel_size=2),
    }
    for name, run in built.items():
        run.export_dir = tmp_path_factory.mktemp(f"export_{name}")
        run.policy.export_hf(run.export_dir)
        if name == "ep2":  # a checkpoint of split experts: saved, one more step, reloaded, the step again
            checkpoint = tmp_path_factory.mktemp("ep2_checkpoint")
            run.policy.save_checkpoint(checkpoint)
            run.saved_logprobs = run.policy.get_logprobs(run.data)["logprobs"]
            run.next_step = run.policy.train(run.data, NLLLoss())
            run.stepped_logprobs = run.policy.get_logprobs(run.data)["logprobs"]
            run.policy.load_checkpoint(checkpoint)
            run.reloaded_logprobs = run.policy.get_logprobs(run.data)["logprobs"]
            run.redone_step = run.policy.train(run.data, NLLLoss())
        run.shutdown()
    return built


def test_megatron_moe_gives_dtensor_logprobs_losses_and_grad_norms(runs):
    baseline, run = runs["dtensor"], runs["ep1"]
    assert baseline.losses[2] < baseline.losses[0]
    torch.testing.assert_close(run.initial_logprobs, baseline.initial_logprobs, atol=1e-5, rtol=0)
    assert_same_training(run, baseline)
    assert_same_expert_load(run, baseline)


EXPERT_LOAD = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_expert_share_min")


def assert_same_expert_load(run: Run, baseline: Run) -> None:
    """The step's tokens per expert, read from Megatron's routing maps and from transformers' routers:
    the same counts (whole tokens) and shares at every step; not all experts equally loaded."""
    for step, expected in zip(run.steps, baseline.steps, strict=True):
        for name in EXPERT_LOAD:
            assert step[name][0] == pytest.approx(expected[name][0], abs=1e-9), name
        fewest, most = expected["moe_tokens_per_expert_min"][0], expected["moe_tokens_per_expert_max"][0]
        assert fewest == int(fewest) and fewest < most


def test_megatron_expert_parallel_trains_and_exports_like_every_expert_on_every_rank(runs):
    """Losses, gradient norms, the gathered HF weights and the exported safetensors (transformers writes
    experts one by one) of EP 2 against EP 1, on the same 2 data-parallel workers."""
    assert_same_training(runs["ep2"], runs["ep1"])
    assert_same_expert_load(runs["ep2"], runs["ep1"])
    one = load_file(runs["ep1"].export_dir / "model.safetensors")
    split = load_file(runs["ep2"].export_dir / "model.safetensors")
    assert split.keys() == one.keys()
    assert any(".experts." in name for name in one)
    for name, tensor in one.items():
        torch.testing.assert_close(split[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_expert_parallel_size_not_dividing_the_experts_names_the_key(ray_session, tmp_path):
    """A 3-expert model split over 2 expert-parallel ranks: a one-line ConfigError before any worker
    starts; an MoE model over pipeline stages: a ValueError where the worker converts it."""
    model_dir = build_model_dir(dataclasses.replace(TINY_MOE, num_experts=3), tmp_path / "three_experts")
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    try:
        with pytest.raises(ConfigError) as error:
            Policy(cluster, policy_config(model_dir, backend="megatron", expert_parallel_size=2))
    finally:
        cluster.shutdown()
    assert str(error.value) == "policy.expert_parallel_size: 2 must divide the model's num_experts=3"
    moe = moe_layout(AutoConfig.from_pretrained(model_dir))
    with pytest.raises(ValueError, match=r"^policy.megatron.pipeline_model_parallel_size=2 with a mixture"):
        check_moe_pipeline(moe, 2)


def test_mixtral_to_megatron_and_back_keeps_logits(ray_session, tmp_path):
    """Mixtral (no q/k norms, experts sized by intermediate_size) in a one-off Ray worker process: the CPU
    shim patches torch.cuda process-wide."""
    cfg = ModelFromConfig(
        architecture="mixtral",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_token=2,
        expert_intermediate_size=32,
        seed=1,
    )
    model_dir = str(build_model_dir(cfg, tmp_path / "mixtral"))
    task = ray_session.remote(num_cpus=0.5, max_calls=1)(megatron_round_trip)
    differences = ray_session.get(task.remote(model_dir))
    assert differences["megatron"] < 1e-5
    assert differences["rebuilt"] == 0.0


def test_megatron_expert_parallel_checkpoint_reloads_to_the_same_next_step(runs):
    """EP 2's checkpoint (each rank's experts in Megatron's sharded format): reloaded after one more step,
    the weights give the saved logprobs exactly, and the step taken again has the same loss and norm."""
    run = runs["ep2"]
    assert not torch.equal(run.stepped_logprobs, run.saved_logprobs)  # the step changed the weights
    torch.testing.assert_close(run.reloaded_logprobs, run.saved_logprobs, atol=0, rtol=0)
    assert run.redone_step["loss"][0] == run.next_step["loss"][0]
    assert run.redone_step["grad_norm"][0] == run.next_step["grad_norm"][0]
