"""The HF decoding loop's shortcuts change no sample: a group's shared prompt is prefilled once, and
finished samples leave the batch once an eighth of it has finished, yet every sample gets the tokens and
logprobs it gets decoded alone."""

from collections import Counter

import pytest
import torch

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import decode as decoding
from posttrain.workers.generation.config import GenerationConfig

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    spec = ModelFromConfig(
        architecture="qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        seed=3,
    )
    model_dir = build_model_dir(spec, tmp_path_factory.mktemp("decode_model"))
    return load_model(str(model_dir)).eval(), load_tokenizer(str(model_dir))


def decode(model, tokenizer, prompts: list[str], sample_indices: list[int], cfg: GenerationConfig):
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.full((len(ids), int(lengths.max())), tokenizer.pad_token_id)
    for row, sequence in enumerate(ids):
        padded[row, : len(sequence)] = torch.tensor(sequence)
    left_ids, mask = decoding.right_to_left_padded(padded, lengths, tokenizer.pad_token_id)
    uniforms = decoding.per_sample_uniforms(7, sample_indices, cfg.max_new_tokens)
    return decoding.decode_batch(model, tokenizer, left_ids, mask, cfg, False, uniforms, [[]] * len(prompts))


def test_groups_and_early_stops_decode_like_single_samples(model_and_tokenizer):
    """4 prompts x 3 samples (one prefill per prompt), a stop token that ends some samples early: each
    sample's tokens equal decoding it alone with the same uniforms, logprobs within 1e-5."""
    model, tokenizer = model_and_tokenizer
    prompts = [p for p in ["12+34=", "7+8=", "99+1=", "5+55="] for _ in range(3)]
    probe = decode(
        model,
        tokenizer,
        prompts,
        list(range(12)),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[]),
    )
    # The tokens most samples draw in their first half: with them as stop tokens, at least half of the
    # batch finishes early (so the finished rows leave the batch, several times) while others run to the end.
    early = Counter(token for ids in probe.generated_ids for token in set(ids[: MAX_NEW_TOKENS // 2]))
    stops = [token for token, _ in early.most_common(2)]
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stops)
    batched = decode(model, tokenizer, prompts, list(range(12)), cfg)
    lengths = [len(ids) for ids in batched.generated_ids]
    assert sum(n < MAX_NEW_TOKENS for n in lengths) >= 6 and max(lengths) == MAX_NEW_TOKENS, lengths
    for i, prompt in enumerate(prompts):
        alone = decode(model, tokenizer, [prompt], [i], cfg)
        assert batched.generated_ids[i] == alone.generated_ids[0]
        assert batched.stopped[i] == alone.stopped[0]
        torch.testing.assert_close(
            torch.tensor(batched.generated_logprobs[i]),
            torch.tensor(alone.generated_logprobs[0]),
            atol=1e-5,
            rtol=0,
        )


def test_reserved_cache_layer_holds_what_concatenation_holds():
    """A reserved layer (room for 3 more positions) against transformers' concatenating layer, through
    appends past its reservation (it doubles), a row selection, and a crop: the same keys and values."""
    from transformers.cache_utils import DynamicLayer

    from posttrain.workers.generation.kv_cache import ReservedLayer

    torch.manual_seed(0)
    prompt_keys, prompt_values = torch.randn(4, 2, 5, 3), torch.randn(4, 2, 5, 3)
    plain = DynamicLayer()
    plain.update(prompt_keys, prompt_values)
    reserved = ReservedLayer(prompt_keys, prompt_values, capacity=8)
    for step in range(6):  # 5 + 6 = 11 positions > 8 reserved
        batch = plain.keys.shape[0]
        new_keys, new_values = torch.randn(batch, 2, 1, 3), torch.randn(batch, 2, 1, 3)
        expected, got = plain.update(new_keys, new_values), reserved.update(new_keys, new_values)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        if step == 2:
            rows = torch.tensor([3, 1])
            plain.reorder_cache(rows)
            reserved.reorder_cache(rows)
    assert reserved.get_seq_length() == plain.get_seq_length() == 11 and reserved.key_buffer.shape[2] == 16
    plain.crop(-4)
    reserved.crop(-4)
    torch.testing.assert_close(reserved.keys, plain.keys, rtol=0, atol=0)
    torch.testing.assert_close(reserved.values, plain.values, rtol=0, atol=0)


def test_the_cache_goes_by_the_name_the_forward_takes(model_and_tokenizer):
    """The decode loop hands the KV cache over under the forward's own keyword (`cache` in transformers 5,
    `past_key_values` before) and reads it back from the output, with no deprecation warning."""
    import inspect
    import warnings

    from posttrain.models.cache_api import cache_argument

    model, tokenizer = model_and_tokenizer

    class OlderForward(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    expected = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert list(cache_argument(model, "c")) == [expected]
    assert cache_argument(OlderForward(), "c") == {"past_key_values": "c"}
    cfg = GenerationConfig(max_new_tokens=4, stop_token_ids=[-1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = decode(model, tokenizer, ["12+34="] * 2, [0, 1], cfg)
    assert [len(tokens) for tokens in state.generated_ids] == [4, 4]
    assert not [w for w in caught if "past_key_values" in str(w.message)]
