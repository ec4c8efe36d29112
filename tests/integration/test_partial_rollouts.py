"""Partial rollouts (experience/partial_rollouts.py) on a real Ray generation worker: a reply cut at a
refit carries the version of the weights that made each token, and its logprobs are those weights'
logprobs token by token; one chunk equals plain generation; async GRPO with partial rollouts learns."""

from __future__ import annotations

import pytest
import torch

from posttrain.distributed import BatchedDataDict
from posttrain.experience.partial_rollouts import (
    ChunkedGeneration,
    PartialReplies,
    assemble_replies,
    token_versions,
)
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import GenerationConfig, HFGeneration

TINY = dict(hidden_size=64, num_layers=2, num_attention_heads=2, intermediate_size=128)
PROMPTS = ["hello", "ab", "the quick brown", "2+2="]
MAX_NEW_TOKENS, CHUNK = 12, 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two weight versions of one architecture: v0 and v1 (another seed)."""
    root = tmp_path_factory.mktemp("partial")
    return build_model_dir(ModelFromConfig(**TINY, seed=0), root / "v0"), build_model_dir(
        ModelFromConfig(**TINY, seed=1), root / "v1"
    )


@pytest.fixture(scope="module")
def generation(ray_session, models):
    """No stop tokens: every reply runs to max_new_tokens, so each is cut at every chunk boundary."""
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, stop_token_ids=[], colocated=False)
    backend = HFGeneration(None, cfg, str(models[0]))
    yield backend
    backend.shutdown()


def prompt_batch(tokenizer) -> BatchedDataDict:
    encoded = [tokenizer(text)["input_ids"] for text in PROMPTS]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded])
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(ids) for ids in encoded]))


@torch.no_grad()
def fresh_logprobs(model, sequence: list[int], temperature: float) -> torch.Tensor:
    """log p(token t | tokens < t) under logits / temperature for t = 1..len-1, one full forward. [T-1]"""
    logits = model(torch.tensor([sequence])).logits[0, :-1].float() / temperature  # [T-1, V]
    return logits.log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def test_a_reply_cut_at_a_refit_keeps_each_tokens_version_and_its_logprobs(ray_session, generation, models):
    """Chunks of 5 of 12 tokens; the refit to v1 comes before the second chunk. Tokens 1-5 of each reply
    carry v0 and their logprobs are v0's (a fresh full forward of v0 over the sequence), tokens 6-12
    carry v1 and v1's logprobs; v0 scores those differently, so the check can fail."""
    tokenizer = load_tokenizer(models[0])
    v1_weights = ray_session.put(load_model(models[1]).state_dict())
    calls = []

    def between_chunks() -> int:
        calls.append(len(calls))
        if len(calls) == 2:
            generation.update_weights(v1_weights)
        return 0 if len(calls) == 1 else 1

    chunked = ChunkedGeneration(generation, CHUNK, MAX_NEW_TOKENS, tokenizer.pad_token_id, between_chunks)
    prompts = prompt_batch(tokenizer)
    out = chunked.generate(prompts, seed=5)
    assert len(calls) == 3  # 5 + 5 + 2 tokens
    assert out["generation_lengths"].tolist() == [MAX_NEW_TOKENS] * len(PROMPTS)
    assert out["truncated"].all()
    assert chunked.take_counts() == {
        "partial/chunks": 3.0,
        "partial/refits_mid_batch": 1.0,
        "partial/tokens_kept_across_refit": float(CHUNK * len(PROMPTS)),
    }
    v0, v1 = load_model(models[0]).eval(), load_model(models[1]).eval()
    for i in range(len(PROMPTS)):
        start = int(prompts["input_lengths"][i])
        sequence = out["output_ids"][i, : start + MAX_NEW_TOKENS].tolist()
        versions = out["generation_weight_versions"][i]
        assert versions[:start].tolist() == [-1] * start
        expected_versions = [0] * CHUNK + [1] * (MAX_NEW_TOKENS - CHUNK)
        assert versions[start : start + MAX_NEW_TOKENS].tolist() == expected_versions
        generated = out["logprobs"][i, start : start + MAX_NEW_TOKENS]  # [12]
        by_v0 = fresh_logprobs(v0, sequence, 0.8)[start - 1 :]  # [12]
        by_v1 = fresh_logprobs(v1, sequence, 0.8)[start - 1 :]
        expected = torch.cat([by_v0[:CHUNK], by_v1[CHUNK:]])
        torch.testing.assert_close(generated, expected, atol=1e-5, rtol=0)
        assert (by_v0[CHUNK:] - generated[CHUNK:]).abs().max() > 0.1
    generation.update_weights(ray_session.put(v0.state_dict()))


def test_one_chunk_equals_plain_generation(generation, models):
    tokenizer = load_tokenizer(models[0])
    prompts = prompt_batch(tokenizer)
    plain = generation.generate(prompts, seed=9)
    chunked = ChunkedGeneration(generation, MAX_NEW_TOKENS, MAX_NEW_TOKENS, tokenizer.pad_token_id, lambda: 4)
    out = chunked.generate(prompts, seed=9)
    for key in ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(out[key], plain[key]), key
    generated = out["generation_weight_versions"] >= 0
    assert (out["generation_weight_versions"][generated] == 4).all() and int(generated.sum()) == 48


def test_assembled_replies_and_token_versions_align_with_the_conversation():
    """Two prompts (lengths 2 and 1); replies of 3 tokens (v0 v0 v1, stopped) and 1 token (v1, cut)."""
    data = {"input_ids": torch.tensor([[7, 8], [9, 0]]), "input_lengths": torch.tensor([2, 1])}
    replies = PartialReplies([[1, 2, 3], [4]], [[-0.5, -1.0, -1.5], [-2.0]], [[0, 0, 1], [1]], [True, False])
    out = assemble_replies(data, replies, pad_id=0)
    assert out["output_ids"].tolist() == [[7, 8, 1, 2, 3], [9, 4, 0, 0, 0]]
    assert out["generation_weight_versions"].tolist() == [[-1, -1, 0, 0, 1], [-1, 1, -1, -1, -1]]
    assert out["logprobs"][0].tolist() == [0.0, 0.0, -0.5, -1.0, -1.5]
    assert out["truncated"].tolist() == [False, True]
    logs = [
        [{"token_ids": [7, 8]}, {"token_ids": [1, 2, 3], "generation_weight_versions": [0, 0, 1]}],
        [{"token_ids": [9]}, {"token_ids": [4], "generation_weight_versions": [1]}, {"token_ids": [5, 6]}],
    ]
    assert token_versions(logs).tolist() == [[-1, -1, 0, 0, 1], [-1, 1, -1, -1, -1]]


@pytest.mark.slow
def test_async_grpo_with_partial_rollouts_learns_and_refits_mid_batch(ray_session, tmp_path):
    """The tiny digit-share task of test_grpo_async (bound 1, one update per step), chunks of one token:
    the batch generated while the trainer trains takes the trainer's new weights mid-reply at least once
    in 12 steps (then its per-token age is below 1, its oldest token 1 step old), and the mean reward of
    the last 3 steps beats the first 3 by > 0.05 (measured: 0.06 -> 0.2 with chunks of 2)."""
    from test_grpo import run_grpo

    run = run_grpo(
        tmp_path,
        **{
            "grpo.async_grpo.enabled": "true",
            "generation.colocated": "false",
            "checkpointing.enabled": "false",
            "grpo.max_num_steps": 12,
            "grpo.async_grpo.max_trajectory_age_steps": 1,
            "grpo.async_grpo.partial_rollouts": "true",
            "grpo.async_grpo.partial_rollout_chunk_tokens": 1,
            "policy.train_global_batch_size": 16,
            "grpo.val_period": 0,
            "generation.max_new_tokens": 8,
        },
    )
    steps = [run[step] for step in range(1, 13)]
    refitted = [m for m in steps if m["train/rollout/partial/refits_mid_batch"] > 0]
    assert refitted, "no batch took new weights between its chunks"
    for metrics in refitted:
        assert metrics["train/async/trajectory_age_max"] == 1.0
        assert metrics["train/async/trajectory_age_mean"] < 1.0
        assert metrics["train/rollout/partial/tokens_kept_across_refit"] > 0
    assert all(m["train/async/trajectory_age_max"] <= 1.0 for m in steps)
    rewards = [m["train/reward_mean"] for m in steps]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
