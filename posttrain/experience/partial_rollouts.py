"""Partial rollouts for asynchronous GRPO: `ChunkedGeneration` generates a batch in chunks of at most
`chunk_tokens` new tokens and, between chunks, lets the producer refit newer weights; the replies still
running continue from their prefix with those weights. Every generated token is tagged with the policy
version that produced it (`generation_weight_versions`).

How a reply continues: its prompt plus the tokens generated so far are sent back as the next chunk's
prompt, so the generation worker prefills the whole prefix again with the weights it now holds; no KV
cache survives a chunk boundary, so none is ever stale (it costs one prefill of the prefix per chunk).
The logprob of each token is the one the generator computed when it drew the token, under the weights of
that chunk: per token, the weights that made it.

Departures from one uninterrupted decode: chunk c > 0 samples with its own seed (derived from the call's
seed and c) and a stop string that spans a chunk boundary is not seen (stop tokens always are). With
one chunk (`chunk_tokens >= max_new_tokens`) the output equals the wrapped backend's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.workers.generation.interface import sample_seed


@dataclass
class PartialReplies:
    """Per sample of one `generate` call: the tokens so far, their logprobs and weight versions."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    stopped: list[bool]  # ended by a stop token or stop string

    @classmethod
    def empty(cls, num_samples: int) -> PartialReplies:
        return cls(
            [[] for _ in range(num_samples)],
            [[] for _ in range(num_samples)],
            [[] for _ in range(num_samples)],
            [False] * num_samples,
        )


def continuation_input(
    data: Any, replies: PartialReplies, rows: list[int], budget: int, pad_id: int
) -> BatchedDataDict:
    """The next chunk's input for samples `rows`: prompt + tokens so far (right-padded), the per-sample
    stop strings and images of the call, and `max_new_tokens` [B] (this chunk's budget)."""
    lengths = data["input_lengths"].long()
    prompts = [
        torch.cat(
            [data["input_ids"][i, : int(lengths[i])], torch.tensor(replies.token_ids[i], dtype=torch.long)]
        )
        for i in rows
    ]
    new_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)  # [b]
    input_ids = torch.full((len(rows), int(new_lengths.max())), pad_id, dtype=torch.long)  # [b, T]
    for j, prompt in enumerate(prompts):
        input_ids[j, : len(prompt)] = prompt
    chunk = BatchedDataDict(
        input_ids=input_ids,
        input_lengths=new_lengths,
        max_new_tokens=torch.full((len(rows),), budget, dtype=torch.long),
    )
    for key in ("stop_strings", "pixel_values", "image_grid_thw"):
        if data.get(key) is not None:
            chunk[key] = [data[key][i] for i in rows]
    return chunk


def add_chunk(
    replies: PartialReplies, rows: list[int], generated: Any, prompt_lengths: torch.Tensor, version: int
) -> None:
    """Append each row's newly generated tokens, logprobs and `version` to its reply."""
    for j, i in enumerate(rows):
        start, length = int(prompt_lengths[j]), int(generated["generation_lengths"][j])
        replies.token_ids[i] += generated["output_ids"][j, start : start + length].tolist()
        replies.logprobs[i] += generated["logprobs"][j, start : start + length].tolist()
        replies.versions[i] += [version] * length
        replies.stopped[i] = not bool(generated["truncated"][j])


def assemble_replies(data: Any, replies: PartialReplies, pad_id: int) -> BatchedDataDict:
    """The generation contract's output keys plus `generation_weight_versions` [B, T_out] (-1 on prompt
    and padding positions)."""
    input_lengths = data["input_lengths"].long()
    generation_lengths = torch.tensor([len(t) for t in replies.token_ids], dtype=torch.long)  # [B]
    sequence_lengths = input_lengths + generation_lengths  # [B]
    num_rows, num_cols = len(sequence_lengths), int(sequence_lengths.max())
    output_ids = torch.full((num_rows, num_cols), pad_id, dtype=torch.long)  # [B, T_out]
    logprobs = torch.zeros(num_rows, num_cols, dtype=torch.float32)  # [B, T_out]
    versions = torch.full((num_rows, num_cols), -1, dtype=torch.long)  # [B, T_out]
    for i, (start, end) in enumerate(zip(input_lengths.tolist(), sequence_lengths.tolist())):
        output_ids[i, :start] = data["input_ids"][i, :start]
        output_ids[i, start:end] = torch.tensor(replies.token_ids[i], dtype=torch.long)
        logprobs[i, start:end] = torch.tensor(replies.logprobs[i], dtype=torch.float32)
        versions[i, start:end] = torch.tensor(replies.versions[i], dtype=torch.long)
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=generation_lengths,
        unpadded_sequence_lengths=sequence_lengths,
        truncated=torch.tensor([not s for s in replies.stopped], dtype=torch.bool),
        generation_weight_versions=versions,
    )


def token_versions(message_logs: list[list[dict]]) -> torch.Tensor:
    """`generation_weight_versions` [B, T] of a batch's conversations, aligned with their concatenated
    token ids and right-padded: each generated token's policy version, -1 on other positions."""

    def message_versions(m: dict) -> torch.Tensor:
        if "generation_weight_versions" in m:
            return torch.as_tensor(m["generation_weight_versions"], dtype=torch.long)
        return torch.full((len(m["token_ids"]),), -1, dtype=torch.long)

    rows = [torch.cat([message_versions(m) for m in log]) for log in message_logs]
    versions = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.long)  # [B, T]
    for i, row in enumerate(rows):
        versions[i, : len(row)] = row
    return versions


class ChunkedGeneration:
    """A generation backend (hf) driven in chunks of `chunk_tokens`: before each chunk `between_chunks()`
    may refit newer weights and returns the version the workers then hold. Counts the chunks, the
    refits between them and the tokens generated before a refit by replies that went on after it (the
    tokens a restart at the refit would have discarded)."""

    def __init__(
        self,
        generation: Any,
        chunk_tokens: int,
        max_new_tokens: int,
        pad_id: int,
        between_chunks: Callable[[], int],
    ) -> None:
        self.generation, self.chunk_tokens, self.max_new_tokens = generation, chunk_tokens, max_new_tokens
        self.pad_id, self.between_chunks = pad_id, between_chunks
        self.num_chunks = self.num_refits = self.num_tokens_kept = 0

    def generate(self, data: Any, greedy: bool = False, seed: int | None = None) -> BatchedDataDict:
        num_samples = int(data["input_ids"].shape[0])
        replies = PartialReplies.empty(num_samples)
        rows, version = list(range(num_samples)), None
        for chunk, done in enumerate(range(0, self.max_new_tokens, self.chunk_tokens)):
            new_version = self.between_chunks()
            if version is not None and new_version != version:
                self.num_refits += 1
                self.num_tokens_kept += sum(len(replies.token_ids[i]) for i in rows)
            version = new_version
            budget = min(self.chunk_tokens, self.max_new_tokens - done)
            chunk_input = continuation_input(data, replies, rows, budget, self.pad_id)
            chunk_seed = seed if seed is None or chunk == 0 else sample_seed(seed, chunk)
            generated = self.generation.generate(chunk_input, greedy=greedy, seed=chunk_seed)
            self.num_chunks += 1
            add_chunk(replies, rows, generated, chunk_input["input_lengths"], version)
            rows = [i for i in rows if not replies.stopped[i]]
            if not rows:
                break
        return assemble_replies(data, replies, self.pad_id)

    def take_counts(self) -> dict[str, float]:
        """Chunks, refits between chunks and tokens kept across a refit since the last call."""
        counts = {
            "partial/chunks": float(self.num_chunks),
            "partial/refits_mid_batch": float(self.num_refits),
            "partial/tokens_kept_across_refit": float(self.num_tokens_kept),
        }
        self.num_chunks = self.num_refits = self.num_tokens_kept = 0
        return counts
