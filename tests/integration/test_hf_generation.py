"""HFGeneration: exact greedy, exact logprobs, stops, truncation, data parallelism, seeding and refit."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_model import TINY

from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import GenerationConfig, HFGeneration
from posttrain.workers.generation.decode import (
    filter_logits,
    right_to_left_padded,
    sample_from_weights,
)

MAX_NEW_TOKENS = 12
PROMPTS = ["hello", "ab", "the quick brown", "2+2=", "xyz", "Once upon", "k", "(1, 2)"]

# ------------------------------------------------------------------------------------------------
# Pure functions (no Ray)
# ------------------------------------------------------------------------------------------------


def test_filter_logits_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    kept = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.equal(torch.isfinite(kept), torch.tensor([[False, True, True, False]]))
    assert torch.equal(kept[torch.isfinite(kept)], torch.tensor([3.0, 2.0]))


def test_filter_logits_top_p_keeps_the_smallest_prefix_reaching_p():
    """probs 0.5, 0.3, 0.2: mass before each = 0, 0.5, 0.8 -> p=0.5 keeps 1 token, p=0.6 keeps 2."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isfinite(filter_logits(logits, None, top_p=0.5)).tolist() == [[True, False, False]]
    assert torch.isfinite(filter_logits(logits, None, top_p=0.6)).tolist() == [[True, True, False]]
    assert torch.isfinite(filter_logits(logits, None, top_p=1.0)).all()


def test_sampling_from_probs_inverts_the_cdf_and_skips_zero_probability_tokens():
    """cdf of [0.2, 0, 0.5, 0.3, 0] is [0.2, 0.2, 0.7, 1.0, 1.0]: u=0.1 -> 0, 0.2 -> 2, 0.69 -> 2, 0.7 ->
    3."""
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]]).repeat(5, 1)
    uniforms = torch.tensor([0.1, 0.2, 0.69, 0.7, 1.0 - 1e-12], dtype=torch.float64)
    assert sample_from_weights(probs, uniforms)[0].tolist() == [0, 2, 2, 3, 3]


def test_two_level_sampling_crosses_block_boundaries_as_one_running_sum():
    """Weights [1, 2, 3, 4] in blocks of 2: block sums [3, 7], running [3, 10]; total 10. u=0.05 -> target
    0.5 -> token 0; u=0.1 -> 1.0 -> token 1 (the first running sum above 1 is 3); u=0.3 -> 3.0 -> block 1,
    then 3 + [3, 7] = [6, 10] -> token 2; u=0.65 -> 6.5 -> token 3. The totals come back in float64."""
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).repeat(4, 1)
    uniforms = torch.tensor([0.05, 0.1, 0.3, 0.65], dtype=torch.float64)
    tokens, totals = sample_from_weights(weights, uniforms, block=2)
    assert tokens.tolist() == [0, 1, 2, 3]
    assert totals.tolist() == [10.0] * 4


def test_two_level_sampling_draws_what_a_full_running_sum_draws():
    """Against the plain inverse CDF (a float64 cumsum over the whole vocabulary), on peaked and flat
    distributions over a vocabulary that is not a multiple of the block (the last block is padded)."""
    generator = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 12.0):
        probs = (torch.randn(64, 1000, generator=generator) * scale).softmax(dim=-1)
        uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
        assert torch.equal(sample_from_weights(probs, uniforms)[0], expected)


def test_right_to_left_padded_moves_prompts_to_the_right_edge():
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]])
    left_ids, mask = right_to_left_padded(ids, torch.tensor([2, 3]), pad_id=0)
    assert left_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]


# ------------------------------------------------------------------------------------------------
# Ray workers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(ModelFromConfig(**TINY), tmp_path_factory.mktemp("gen_model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompt_batch(tokenizer, PROMPTS)


def sampling_config(**overrides) -> GenerationConfig:
    base = dict(max_new_tokens=MAX_NEW_TOKENS, temperature=0.7, top_p=0.9, top_k=30, colocated=False)
    return GenerationConfig(**(base | overrides))


@pytest.fixture(scope="module")
def one_worker(ray_session, model_dir):
    generation = HFGeneration(None, sampling_config(num_workers=1), str(model_dir))
    yield generation
    generation.shutdown()


@pytest.fixture(scope="module")
def two_workers(ray_session, model_dir):
    """Two workers placed on a cluster given from outside (as when colocated with the policy)."""
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    generation = HFGeneration(cluster, sampling_config(num_workers=2, colocated=True), str(model_dir))
    yield generation
    generation.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def refit_worker(ray_session, model_dir):
    """Default sampling (temperature 1, no top-k, no top-p); each test loads the full weights it needs."""
    generation = HFGeneration(None, GenerationConfig(max_new_tokens=8, colocated=False), str(model_dir))
    yield generation
    generation.shutdown()


def make_prompt_batch(tokenizer, texts: list[str]) -> BatchedDataDict:
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded])
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(ids) for ids in encoded]))


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Single-sequence greedy decoding without cache or padding: the full forward at every step."""
    sequence = list(prompt_ids)
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([sequence])).logits[0, -1].argmax())
        sequence.append(token)
        if token == eos_id:
            break
    return sequence


def unpadded_outputs(outputs) -> list[list[int]]:
    lengths = outputs["unpadded_sequence_lengths"].tolist()
    return [outputs["output_ids"][i, :n].tolist() for i, n in enumerate(lengths)]


def prompt_ids(batch, i: int) -> list[int]:
    return batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist()


def test_greedy_equals_single_process_greedy_decode(one_worker, prompts, model_dir, tokenizer):
    outputs = one_worker.generate(prompts, greedy=True)
    model = load_model(model_dir).eval()
    expected = [
        reference_greedy(model, prompt_ids(prompts, i), MAX_NEW_TOKENS, tokenizer.eos_token_id)
        for i in range(len(PROMPTS))
    ]
    assert unpadded_outputs(outputs) == expected
    assert outputs["generation_lengths"].tolist() == [
        len(e) - len(prompt_ids(prompts, i)) for i, e in enumerate(expected)
    ]
    pad_cols = (
        torch.arange(outputs["output_ids"].shape[1])[None] >= outputs["unpadded_sequence_lengths"][:, None]
    )
    assert (outputs["output_ids"][pad_cols] == tokenizer.pad_token_id).all()


def test_logprobs_equal_log_softmax_of_a_recomputed_forward(one_worker, prompts, model_dir):
    """Sampled with T=0.7, top-k 30, top-p 0.9: logprobs are of the unfiltered logits / 0.7."""
    outputs = one_worker.generate(prompts, seed=11)
    model = load_model(model_dir).eval()
    for i, sequence in enumerate(unpadded_outputs(outputs)):
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0]  # [T, V]
        expected = torch.zeros(outputs["logprobs"].shape[1])
        token_logprobs = (
            (logits[:-1] / 0.7).log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
        )
        start = int(prompts["input_lengths"][i])
        expected[start : len(sequence)] = token_logprobs[start - 1 :]
        torch.testing.assert_close(outputs["logprobs"][i], expected, atol=1e-5, rtol=0)


def test_stop_strings_stop_right_after_the_string_and_keep_it(one_worker, prompts, tokenizer):
    """With one seed, a sample draws the same tokens with or without stop strings, until it stops."""
    sampled = one_worker.generate(prompts, seed=21)
    generated = [ids[int(prompts["input_lengths"][i]) :] for i, ids in enumerate(unpadded_outputs(sampled))]
    stops = {0: tokenizer.decode(generated[0][4:6]), 2: tokenizer.decode(generated[2][7:8])}
    stop_strings = [[stops[0]], None, ["never-generated", stops[2]]] + [None] * (len(PROMPTS) - 3)
    stopped = one_worker.generate(BatchedDataDict(prompts | {"stop_strings": stop_strings}), seed=21)
    for i, stop in stops.items():
        # The shortest prefix whose text contains the stop string: generation ends right there.
        expected_len = next(
            n for n in range(1, MAX_NEW_TOKENS + 1) if stop in tokenizer.decode(generated[i][:n])
        )
        assert unpadded_outputs(stopped)[i] == prompt_ids(prompts, i) + generated[i][:expected_len]
        assert int(stopped["generation_lengths"][i]) == expected_len
        assert not bool(stopped["truncated"][i])
    assert unpadded_outputs(stopped)[1] == unpadded_outputs(sampled)[1]


def test_max_new_tokens_truncation_is_flagged(one_worker, prompts, tokenizer):
    outputs = one_worker.generate(prompts, greedy=True)
    for i, sequence in enumerate(unpadded_outputs(outputs)):
        hit_eos = sequence[-1] == tokenizer.eos_token_id
        assert bool(outputs["truncated"][i]) == (not hit_eos)
        if not hit_eos:
            assert int(outputs["generation_lengths"][i]) == MAX_NEW_TOKENS
    assert outputs["truncated"].any()


def test_two_workers_give_the_same_outputs_as_one(one_worker, two_workers, prompts):
    for kwargs in ({"greedy": True}, {"seed": 5}):
        one, two = one_worker.generate(prompts, **kwargs), two_workers.generate(prompts, **kwargs)
        assert torch.equal(one["output_ids"], two["output_ids"])
        assert torch.equal(one["generation_lengths"], two["generation_lengths"])
        torch.testing.assert_close(one["logprobs"], two["logprobs"], atol=1e-5, rtol=0)


def test_same_seed_gives_the_same_samples_and_another_seed_differs(one_worker, prompts):
    first, again = one_worker.generate(prompts, seed=7), one_worker.generate(prompts, seed=7)
    other = one_worker.generate(prompts, seed=8)
    assert torch.equal(first["output_ids"], again["output_ids"])
    assert torch.equal(first["logprobs"], again["logprobs"])
    assert not torch.equal(first["output_ids"], other["output_ids"])


def test_greedy_after_update_weights_equals_decoding_with_the_new_weights(
    refit_worker, prompts, tmp_path, tokenizer, ray_session
):
    new_model = load_model(build_model_dir(ModelFromConfig(**TINY, seed=1), tmp_path / "new")).eval()
    seconds = refit_worker.update_weights(ray_session.put(new_model.state_dict()))
    assert seconds >= 0.0
    # A partial refit: only one changed tensor travels.
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        new_model.get_parameter(name).mul_(-3.0)
    refit_worker.update_weights({name: new_model.get_parameter(name).detach().clone()})
    outputs = refit_worker.generate(prompts, greedy=True)
    expected = [
        reference_greedy(new_model, prompt_ids(prompts, i), 8, tokenizer.eos_token_id)
        for i in range(len(PROMPTS))
    ]
    assert unpadded_outputs(outputs) == expected


def test_update_weights_with_an_unknown_name_fails_naming_it(refit_worker):
    with pytest.raises(Exception, match="model.not_a_weight"):
        refit_worker.update_weights({"model.not_a_weight": torch.zeros(1)})


def test_top_k_none_samples_every_token_of_a_flat_distribution(refit_worker, model_dir, tokenizer):
    """Zeroing the final norm makes every logit 0: each token has logprob -log(V); no hidden top-k."""
    weights = load_model(model_dir).state_dict()
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    refit_worker.update_weights(weights)
    batch = make_prompt_batch(tokenizer, PROMPTS * 4)
    outputs = refit_worker.generate(batch, seed=3)
    generated = outputs["logprobs"] != 0  # [B, T_out]
    num_vocab = load_model(model_dir).config.vocab_size
    torch.testing.assert_close(
        outputs["logprobs"][generated],
        torch.full((int(generated.sum()),), -math.log(num_vocab)),
        atol=1e-6,
        rtol=0,
    )
    assert len(set(outputs["output_ids"][generated].tolist())) > 50


def refit_with_scaled_weights(generation, model_dir) -> None:
    """Refit `generation` with the model's weights x 1.5 (through the object store) and make them its
    weights source, what a worker that replaces a lost one loads."""
    import ray

    new_model = load_model(str(model_dir))
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.mul_(1.5)
    weights = ray.put(new_model.state_dict())
    generation.update_weights(weights)
    generation.set_weights_source(lambda: weights)


def test_a_worker_lost_mid_generate_is_replaced_with_the_current_weights(
    ray_session, model_dir, prompts, tmp_path, monkeypatch
):
    """Two workers apart from the policy take new weights; rank 1 dies in its second generate call. The
    handle starts a replacement, loads it from the weights source and decodes rank 1's shard again: the
    batch equals the first call's, sample for sample. The second loss finds no restart left and raises."""
    from lost_generation_worker import dies_once_worker

    from posttrain.distributed import WorkerDiedError

    monkeypatch.setattr(HFGeneration, "worker_cls", dies_once_worker(tmp_path / "died", on_call=2))
    generation = HFGeneration(None, sampling_config(num_workers=2), str(model_dir), max_worker_restarts=1)
    try:
        refit_with_scaled_weights(generation, model_dir)
        first = generation.generate(prompts, seed=11)
        lost_name = generation.worker_group.names[1]
        again = generation.generate(prompts, seed=11)  # rank 1 dies, is replaced, decodes its shard again
        assert (tmp_path / "died").exists() and generation.num_worker_restarts == 1
        assert generation.worker_group.names[1] != lost_name
        for key in ("output_ids", "logprobs", "generation_lengths"):
            assert torch.equal(again[key], first[key]), key
        (tmp_path / "died").unlink()  # the replacement dies in its second call too: no restart left
        with pytest.raises(WorkerDiedError):
            generation.generate(prompts, seed=11)
    finally:
        generation.shutdown()
