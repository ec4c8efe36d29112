"""Tiny seeded models built from an architecture config, and the loaders every backend uses."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.models.tokenizer import build_byte_tokenizer, build_char_tokenizer

TINY = dict(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64)


def weights_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_same_seed_writes_identical_weights_and_other_seed_differs(tmp_path):
    first = weights_of(build_model_dir(ModelFromConfig(**TINY, seed=3), tmp_path / "a"))
    second = weights_of(build_model_dir(ModelFromConfig(**TINY, seed=3), tmp_path / "b"))
    other = weights_of(build_model_dir(ModelFromConfig(**TINY, seed=4), tmp_path / "c"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    embedding = "model.embed_tokens.weight"
    assert not torch.equal(first[embedding], other[embedding])


def test_build_leaves_the_global_torch_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model_dir(ModelFromConfig(**TINY), tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_reloaded_model_gives_the_logits_of_the_saved_weights(tmp_path):
    model_dir = build_model_dir(ModelFromConfig(**TINY, seed=1), tmp_path / "m")
    model = load_model(model_dir).eval()
    again = load_model(model_dir).eval()
    input_ids = torch.tensor([[1, 40, 41, 42, 2], [1, 50, 51, 2, 0]])  # [B=2, T=5]
    with torch.no_grad():
        logits = model(input_ids).logits  # [2, 5, V]
        logits_again = again(input_ids).logits
    assert logits.shape == (2, 5, len(build_char_tokenizer()))
    assert torch.equal(logits, logits_again)
    # The saved tensors are the ones in the loaded model.
    saved = weights_of(model_dir)
    loaded = model.state_dict()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_config_takes_sizes_from_the_dataclass_and_ids_from_the_tokenizer(tmp_path, architecture):
    cfg = ModelFromConfig(architecture=architecture, **TINY, num_key_value_heads=1)
    model = load_model(build_model_dir(cfg, tmp_path / architecture))
    config = model.config
    assert config.model_type == architecture
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (105, 32, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 64)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # hidden 32, 2 layers, 2 heads of 16, 1 kv head, FFN 64, vocab 105, tied:
    # embed 105*32=3360; per layer q 32*32(+32 bias for qwen2) + k,v 2*(32*16(+16)) + o 32*32
    # + mlp 3*32*64 + 2 norms*32; final norm 32.
    attention_bias = 32 + 2 * 16 if architecture == "qwen2" else 0
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 + attention_bias
    assert sum(p.numel() for p in model.parameters()) == 3360 + 2 * per_layer + 32


def test_loaded_tokenizer_keeps_the_chat_template_and_special_ids(tmp_path):
    tokenizer = load_tokenizer(build_model_dir(ModelFromConfig(**TINY), tmp_path / "m"))
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids) == "<|user|>hi<|assistant|>"


def test_tokenizer_without_pad_token_falls_back_to_eos(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).pad_token_id == 2


def test_invalid_architecture_is_named_in_the_error():
    with pytest.raises(ValueError, match="architecture: 'gpt9'"):
        ModelFromConfig(architecture="gpt9").validate()


def test_byte_tokenizer_option_sets_the_vocabulary_and_is_saved_with_the_model(tmp_path):
    model_dir = build_model_dir(ModelFromConfig(**TINY, tokenizer="byte"), tmp_path / "m")
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    assert model.config.vocab_size == len(tokenizer) == len(build_byte_tokenizer()) == 300
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert tokenizer.get_vocab() == build_byte_tokenizer().get_vocab()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "héllo"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids) == "<|user|>héllo<|assistant|>"


def test_invalid_tokenizer_is_named_in_the_error():
    with pytest.raises(ValueError, match="tokenizer: 'word'"):
        ModelFromConfig(tokenizer="word").validate()


def test_create_model_command_takes_the_tokenizer_option(tmp_path, capsys):
    from posttrain.cli import main

    assert (
        main(["create-model", str(tmp_path / "m"), "hidden_size=32", "num_layers=1", "tokenizer=byte"]) == 0
    )
    assert len(load_tokenizer(tmp_path / "m")) == 300
    assert main(["create-model", str(tmp_path / "x"), "tokenizer=word"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_policy_from_config_takes_the_tokenizer_override():
    from posttrain.algorithms.sft import SFTConfig
    from posttrain.config import ConfigError, load_typed_config

    config = Path(__file__).parents[2] / "configs" / "sft_tiny.yaml"
    assert load_typed_config(SFTConfig, config, []).policy.model.from_config.tokenizer == "char"
    cfg = load_typed_config(SFTConfig, config, ["policy.model.from_config.tokenizer=byte"])
    assert cfg.policy.model.from_config.tokenizer == "byte"
    with pytest.raises(ConfigError, match="policy.model.from_config.tokenizer"):
        load_typed_config(SFTConfig, config, ["policy.model.from_config.tokenizer=word"])
