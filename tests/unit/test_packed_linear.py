"""Prepacked (oneDNN) linear layers for CPU generation: the same model function, the same parameters, and
a packed copy that is only as new as the last `pack_linears`."""

import pytest
import torch

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.packed_linear import (
    PACKED_ATTR,
    pack_linears,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture()
def model_dir(tmp_path):
    spec = ModelFromConfig(
        architecture="qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        seed=5,
    )
    return str(build_model_dir(spec, tmp_path))


@pytest.fixture()
def model(model_dir):
    return load_model(model_dir).eval()


def logits(model, input_ids):
    with torch.inference_mode():
        return model(input_ids=input_ids).logits


def test_packed_model_gives_the_plain_logits_and_keeps_its_parameters(model):
    """Qwen2 (biased q/k/v, unbiased o/MLP, tied head): 2 layers x 7 projections + the head = 15 packed;
    logits over a [3, 9] batch equal the plain model's (fp32, 1e-5); state dict names and tensors
    unchanged."""
    input_ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    plain = logits(model, input_ids)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 15
    torch.testing.assert_close(logits(model, input_ids), plain, atol=1e-5, rtol=0)
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    for name, tensor in state_before.items():
        assert torch.equal(state_after[name], tensor), name


def test_the_packed_copy_follows_the_weights_only_when_repacked(model, model_dir):
    """An in-place change of a weight (what a refit does) reaches the packed forward at the next
    pack_linears, not before: the reason the generation worker repacks after every refit. A repack redoes
    only the changed layer (1 of 15); `force` redoes all (weights written by another process)."""
    input_ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert pack_linears(model) == 15
    assert pack_linears(model) == 0  # nothing changed
    old = logits(model, input_ids)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    torch.testing.assert_close(logits(model, input_ids), old, atol=0, rtol=0)  # stale until repacked
    assert pack_linears(model) == 1
    repacked = logits(model, input_ids)
    assert pack_linears(model, force=True) == 15
    torch.testing.assert_close(logits(model, input_ids), repacked, atol=0, rtol=0)
    plain = load_model(model_dir).eval()  # torch's own linear, with the same change
    with torch.no_grad():
        plain.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    torch.testing.assert_close(repacked, logits(plain, input_ids), atol=1e-5, rtol=0)
    assert (repacked - old).abs().max() > 1e-3


def test_only_fp32_linears_on_a_cpu_are_packed():
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(layers) == 1
    assert hasattr(layers[0], PACKED_ATTR) and not hasattr(layers[1], PACKED_ATTR)


def test_generation_workers_pack_unless_told_not_to_and_sample_alike(model_dir):
    """HFGenerationWorker packs its 15 linear layers by default and none with generation.packed_weights=False;
    both draw the same 16 tokens for 4 prompts (same seed) with logprobs within 1e-4."""
    tokenizer = load_tokenizer(model_dir)
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["12+34=", "7+8=", "abc", "x"]]
    prompts = BatchedDataDict.from_batches(
        [{"input_ids": torch.tensor([ids]), "input_lengths": torch.tensor([len(ids)])} for ids in rows],
        pad_value_dict={"input_ids": tokenizer.pad_token_id},
    )
    outputs = {}
    for packed in (True, False):
        cfg = GenerationConfig(backend="hf", max_new_tokens=4, stop_token_ids=[], packed_weights=packed)
        worker = HFGenerationWorker(cfg, model_dir)
        assert sum(hasattr(m, PACKED_ATTR) for m in worker.model.modules()) == (15 if packed else 0)
        outputs[packed] = worker.generate(prompts, seed=3)
    assert torch.equal(outputs[True]["output_ids"], outputs[False]["output_ids"])
    torch.testing.assert_close(outputs[True]["logprobs"], outputs[False]["logprobs"], atol=1e-4, rtol=0)
