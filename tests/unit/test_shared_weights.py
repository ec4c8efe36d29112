"""Shared-memory weights: aligned slots, and another process of the machine reads what the writer wrote."""

import pickle
import subprocess
import sys

import pytest
import torch

from posttrain.distributed.shared_weights import (
    ALIGNMENT,
    SharedWeightsReader,
    SharedWeightsWriter,
    plan_slots,
    shared_memory_supported,
)

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs memfd and /proc (Linux)")


def test_slots_are_aligned_and_sized_by_dtype():
    # 3 fp32 (12 bytes -> one 64-byte line), then 40 bf16 (80 bytes -> two lines), then 1 fp32.
    slots, size = plan_slots(
        {"a": ((3,), torch.float32), "b": ((4, 10), torch.bfloat16), "c": ((1,), torch.float32)}
    )
    assert [slots[n].offset for n in "abc"] == [0, ALIGNMENT, 3 * ALIGNMENT]
    assert slots["b"].shape == (4, 10) and slots["b"].dtype == "bfloat16"
    assert size == 4 * ALIGNMENT


def test_another_process_reads_what_the_writer_writes_in_place():
    writer = SharedWeightsWriter({"w": ((2, 3), torch.float32), "b": ((5,), torch.bfloat16)}, node_id="n1")
    try:
        writer.views["w"].copy_(torch.arange(6.0).view(2, 3))
        writer.views["b"].fill_(0.5)
        reader = (
            "import pickle, sys, torch\n"
            "from posttrain.distributed.shared_weights import SharedWeightsReader\n"
            "v = SharedWeightsReader(pickle.load(sys.stdin.buffer), 'n1', torch.device('cpu')).views; "
            "print(v['w'].flatten().tolist(), "
            "v['b'].float().tolist())"
        )

        def read():
            reply = subprocess.run(
                [sys.executable, "-c", reader],
                input=pickle.dumps(writer.handle),
                capture_output=True,
                check=True,
            )
            return reply.stdout.decode()

        assert read() == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] [0.5, 0.5, 0.5, 0.5, 0.5]\n"
        writer.views["w"].mul_(-1)  # an in-place update is what the next reader sees
        assert read().startswith("[-0.0, -1.0, -2.0, -3.0, -4.0, -5.0]")
    finally:
        writer.close()


def test_mapping_on_another_node_fails_naming_both_nodes():
    writer = SharedWeightsWriter({"w": ((2,), torch.float32)}, node_id="node-a")
    try:
        with pytest.raises(RuntimeError, match="node-a.*node-b"):
            SharedWeightsReader(writer.handle, "node-b", torch.device("cpu"))
    finally:
        writer.close()


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from posttrain.models.build import ModelFromConfig, build_model_dir

    spec = ModelFromConfig(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
        seed=1,
    )
    return build_model_dir(spec, tmp_path_factory.mktemp("tied_model"))


def test_generator_parameters_are_views_of_one_flat_bf16_buffer(tied_model_dir):
    """The policy's fp32 weights written with one cast-and-copy into a bf16 buffer: each parameter of the bf16
    generation model is a view of it at its slot's offset, the tied embedding / LM head one slot (the state
    dict has one name more than the slots), and a write through the buffer changes the generator's model."""
    from posttrain.distributed.shared_weights import use_as_parameters
    from posttrain.models.build import load_model

    policy = load_model(str(tied_model_dir))
    generator = load_model(str(tied_model_dir), dtype=torch.bfloat16)
    params = dict(policy.named_parameters())
    writer = SharedWeightsWriter({name: (tuple(p.shape), torch.bfloat16) for name, p in params.items()}, "n1")
    try:
        writer.write(params)
        reader = SharedWeightsReader(writer.handle, "n1", torch.device("cpu"))
        use_as_parameters(generator, reader.views)
        assert len(generator.state_dict()) == len(writer.handle.slots) + 1
        base = reader.buffer.data_ptr()
        for name, parameter in generator.named_parameters():
            assert parameter.dtype == torch.bfloat16
            assert parameter.data_ptr() == base + writer.handle.slots[name].offset, name
            torch.testing.assert_close(parameter, params[name].to(torch.bfloat16), atol=0, rtol=0)
        assert generator.lm_head.weight.data_ptr() == generator.model.embed_tokens.weight.data_ptr()
        head_before = generator.lm_head.weight.detach().clone()
        with torch.no_grad():
            params["model.embed_tokens.weight"].mul_(2.0)  # doubling is exact in bf16
        writer.write(params)
        torch.testing.assert_close(generator.lm_head.weight, 2 * head_before, atol=0, rtol=0)
    finally:
        writer.close()


def test_generation_after_a_shared_refit_equals_the_object_store_refit(tied_model_dir):
    """A generation worker refitted through the shared buffer (mapped once, then rewritten in place) decodes
    greedily what a worker refitted by copying a state dict (the object-store path) decodes, after each of
    two updates of the policy's weights (noise added); and the new weights change what it decodes."""
    from posttrain.models.build import load_model, load_tokenizer
    from posttrain.workers.generation.config import GenerationConfig
    from posttrain.workers.generation.hf_worker import HFGenerationWorker

    tokenizer = load_tokenizer(str(tied_model_dir))
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ["1+1=", "hello there"]]
    width = max(map(len, ids))
    data = {
        "input_ids": torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]),
        "input_lengths": torch.tensor([len(row) for row in ids]),
    }
    cfg = GenerationConfig(max_new_tokens=8, stop_token_ids=[], packed_weights=False)
    shared, copied = (
        HFGenerationWorker(cfg, str(tied_model_dir)),
        HFGenerationWorker(cfg, str(tied_model_dir)),
    )
    policy = load_model(str(tied_model_dir))
    params = dict(policy.named_parameters())
    writer = SharedWeightsWriter({name: (tuple(p.shape), p.dtype) for name, p in params.items()}, "n1")
    before = shared.generate(data, greedy=True)["output_ids"]
    try:
        for seed in (0, 1):
            noise = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for tensor in params.values():
                    tensor.add_(torch.randn(tensor.shape, generator=noise), alpha=0.5)
            writer.write(params)
            shared.update_weights(writer.handle)
            copied.update_weights({k: v.clone() for k, v in policy.state_dict().items()})
            outputs = shared.generate(data, greedy=True)["output_ids"]
            assert torch.equal(outputs, copied.generate(data, greedy=True)["output_ids"])
        assert not torch.equal(outputs, before)
    finally:
        writer.close()
