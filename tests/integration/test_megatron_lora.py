"""LoRA on the Megatron Core backend (real Ray actors, gloo, the CPU shim): from the same initial adapter,
TP 2 with sequence parallelism gives the DTensor LoRA policy's losses, grad norms, reference logprobs and
refit payload (PEFT format, q/k/v and gate/up split back from Megatron's fused linears); only the adapter
trains; an adapter-only checkpoint saved at TP 2 resumes at PP 2 like the uninterrupted run; `posttrain
export` writes a PEFT adapter and a merged model that reproduce the policy."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

pytest.importorskip("megatron.core", reason="policy.backend=megatron needs posttrain[megatron]")

from test_lora import (  # noqa: E402
    assert_exports_reproduce,
    direct_logprobs,
    make_train_data,
    start_policy,
    train_losses,
)
from transformers import AutoModelForCausalLM  # noqa: E402

from posttrain.algorithms.loss import NLLLoss  # noqa: E402
from posttrain.models import lora  # noqa: E402
from posttrain.models.build import ModelFromConfig, build_model_dir  # noqa: E402

NUM_STEPS = 3
# Llama, hidden 32, 4 heads of 8 (2 kv heads), MLP 64, rank 4. Per layer and TP rank (TP 2): q A [4, 32] + B
# [16, 4] = 192, k and v 128 + [8, 4] = 160 each, o A [4, 16] + B [32, 4] = 192, gate and up 128 + [32, 4] =
# 256 each, down A [4, 32] + B [32, 4] = 256: 1472 parameters, 2944 for 2 layers, 11,776 bytes in fp32.
RANK_ADAPTER_BYTES = 2944 * 4
NUM_ADAPTER_TENSORS = 2 * 7 * 2  # layers x HF modules x (A, B)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with grouped-query attention and tied embeddings (as
    tests/integration/test_megatron.py)."""
    cfg = ModelFromConfig(
        architecture="llama",
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_llama"))


def megatron(**parallel) -> dict:
    return {"backend": "megatron", "megatron": parallel}


@pytest.fixture(scope="module")
def runs(ray_session, model_dir, tmp_path_factory):
    """DTensor LoRA on 1 worker; Megatron LoRA at TP 2 + SP from the DTensor policy's initial adapter
    (checkpoint after step 1); Megatron LoRA at PP 2 resuming that checkpoint. One policy at a time."""
    out = tmp_path_factory.mktemp("megatron_lora")
    data, found = make_train_data(), {"out": out, "checkpoint": out / "step_1" / "policy"}

    cluster, policy = start_policy(model_dir, 1, init_reference_model=True)
    found["initial_adapter"] = ray_session.get(policy.get_weights(only_changed=False))
    found["dtensor_reference"] = policy.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    found["dtensor_steps"] = [policy.train(data, NLLLoss()) for _ in range(NUM_STEPS)]
    found["dtensor_adapter"] = ray_session.get(policy.get_weights(only_changed=False))
    policy.shutdown()
    cluster.shutdown()

    cluster, policy = start_policy(
        model_dir,
        2,
        init_reference_model=True,
        **megatron(tensor_model_parallel_size=2, sequence_parallel=True),
    )
    found["own_initial_adapter"] = ray_session.get(policy.get_weights(only_changed=False))
    policy.worker_group.run_all("load_adapter", adapter=found["initial_adapter"])
    found["footprint"] = policy.memory_footprint()
    found["reference"] = policy.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    found["steps"] = [policy.train(data, NLLLoss())]
    policy.save_checkpoint(str(found["checkpoint"]))
    found["checkpoint_logprobs"] = policy.get_logprobs(data)["logprobs"]
    found["steps"] += [policy.train(data, NLLLoss()) for _ in range(NUM_STEPS - 1)]
    found["footprint_after"] = policy.memory_footprint()
    found["adapter"] = ray_session.get(policy.get_weights())
    found["refit_bytes"] = policy.last_weights_bytes()
    found["logprobs"] = policy.get_logprobs(data)["logprobs"]
    policy.export_hf(str(out / "hf_model"))
    policy.shutdown()
    cluster.shutdown()

    cluster, policy = start_policy(model_dir, 2, **megatron(pipeline_model_parallel_size=2))
    policy.load_checkpoint(str(found["checkpoint"]))
    found["resumed_losses"] = train_losses(policy, data, NUM_STEPS - 1)
    found["resumed_adapter"] = ray_session.get(policy.get_weights())
    policy.shutdown()
    cluster.shutdown()
    return found


def losses(steps: list[dict], key: str = "loss") -> list[float]:
    return [step[key][0] for step in steps]


def assert_same_adapter(actual: lora.AdapterWeights, expected: lora.AdapterWeights, atol: float) -> None:
    assert set(actual.tensors) == set(expected.tensors)
    for name, tensor in expected.tensors.items():
        torch.testing.assert_close(actual.tensors[name], tensor, atol=atol, rtol=0, msg=name)


def test_megatron_lora_at_tp2_gives_the_dtensor_lora_losses_and_adapter(runs):
    assert losses(runs["steps"]) == pytest.approx(losses(runs["dtensor_steps"]), abs=1e-5)
    assert losses(runs["steps"], "grad_norm") == pytest.approx(
        losses(runs["dtensor_steps"], "grad_norm"), abs=1e-5
    )
    assert losses(runs["steps"])[-1] < losses(runs["steps"])[0] - 0.1
    # the refit payload: PEFT names of the HF model, q/k/v and gate/up split back out of the fused linears
    assert_same_adapter(runs["adapter"], runs["dtensor_adapter"], atol=1e-5)
    assert (
        runs["refit_bytes"] == runs["adapter"].num_bytes == 4096 * 4
    )  # 2 layers x 2048 parameters, unsharded


def test_megatron_lora_starts_as_peft_does(runs):
    """Its own initial adapter: peft's names and shapes, B = 0, A uniform in +-1/sqrt(in features)."""
    own, peft_initial = runs["own_initial_adapter"], runs["initial_adapter"]
    assert {n: t.shape for n, t in own.tensors.items()} == {
        n: t.shape for n, t in peft_initial.tensors.items()
    }
    for name, tensor in own.tensors.items():
        if ".lora_B." in name:
            assert not tensor.any()
        else:
            assert 0 < tensor.abs().max() <= tensor.shape[1] ** -0.5


def test_only_the_adapter_trains_and_the_optimizer_holds_only_its_state(runs):
    """Each TP rank's adapter shard is 11,776 bytes (derived above); Adam keeps exp_avg, exp_avg_sq and a
    4-byte step per adapter tensor."""
    for before, after in zip(runs["footprint"], runs["footprint_after"]):
        assert before["trainable_param_bytes"] == RANK_ADAPTER_BYTES
        assert before["param_bytes"] > 3 * RANK_ADAPTER_BYTES  # the frozen base shard
        assert after["optimizer_state_bytes"] == 2 * RANK_ADAPTER_BYTES + 4 * NUM_ADAPTER_TENSORS


def test_reference_logprobs_are_the_base_model_with_adapters_off(runs, model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = direct_logprobs(base, make_train_data())
    torch.testing.assert_close(runs["reference"], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(runs["dtensor_reference"], expected, atol=1e-5, rtol=0)


def test_the_refit_adapter_on_a_hf_base_gives_the_policy_logprobs(runs, model_dir):
    """What HF generation does with the payload (lora.apply_adapter on its resident base)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with_adapter = lora.apply_adapter(base, runs["adapter"]).eval()
    torch.testing.assert_close(
        direct_logprobs(with_adapter, make_train_data()), runs["logprobs"], atol=1e-5, rtol=0
    )


def test_checkpoint_saved_at_tp2_resumes_at_pp2_like_the_uninterrupted_run(runs):
    assert runs["resumed_losses"] == pytest.approx(losses(runs["steps"])[1:], abs=1e-5)
    assert_same_adapter(runs["resumed_adapter"], runs["adapter"], atol=1e-5)


def test_export_of_a_megatron_lora_checkpoint_reproduces_the_policy(runs, model_dir):
    assert_exports_reproduce(
        runs["checkpoint"].parent,
        runs["out"],
        model_dir,
        make_train_data(),
        runs["checkpoint_logprobs"],
        runs["logprobs"],
    )
