"""The HF backend's decode loop with the host out of each step, for dense text models: a static KV cache
(transformers' StaticCache) and a static additive attention mask, sampling and the finished flags on the
device, the host reading the flags every `sync_every` steps (and compacting finished rows then), and on
CUDA each step replayed as a CUDA graph, one per batch size. Same tokens and logprobs as
decode.decode_batch, which stays for what this loop does not cover (`use_static_loop`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import StaticCache, StaticLayer

from posttrain.models.cache_api import cache_argument
from posttrain.models.moe import is_moe_model
from posttrain.models.vlm import is_vision_language_model
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.decode import (
    DecodeState,
    choose_tokens,
    compacted_size,
    prefill,
    resolve_stop_token_ids,
    update_decode_state,
)


def use_static_loop(
    model: torch.nn.Module, cfg: GenerationConfig, stop_strings: list[list[str]], images: bool
) -> bool:
    """Decode this batch with the static loop? `generation.decode_loop`: static, eager, or auto: static on a
    GPU where it applies. It covers dense text models with full attention under sdpa or eager attention (no
    LoRA adapter on top), without images or stop strings (they need the text every step); asking for it
    elsewhere raises, naming what it does not cover."""
    reason = None
    if is_moe_model(model) or is_vision_language_model(model) or images:
        reason = "a mixture-of-experts or vision-language model, or images"
    elif not isinstance(model, PreTrainedModel):
        reason = f"a {type(model).__name__} (a LoRA adapter on the model)"
    elif getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        reason = f"attention implementation {model.config._attn_implementation!r}"
    elif any(stop_strings):
        reason = "stop strings"
    elif any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or []):
        reason = "sliding-window or linear attention layers"
    elif rope_type(model.config) in HOST_ROPE_TYPES:
        reason = f"rope_type {rope_type(model.config)!r} (it reads the positions back to the host each step)"
    if cfg.decode_loop == "static" and reason is not None:
        raise ValueError(f"generation.decode_loop='static' does not cover {reason}: use 'auto' or 'eager'")
    on_gpu = next(model.parameters()).device.type == "cuda"
    return reason is None and (cfg.decode_loop == "static" or on_gpu)


HOST_ROPE_TYPES = ("dynamic", "longrope")  # rotary scalings that compare positions on the host per forward


def rope_type(config: Any) -> str:
    """The model's rotary scaling type (`rope_parameters` in transformers 5, `rope_scaling` before)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"


@dataclass
class DecodeRows:
    """The device state of the rows being decoded; every field's first dimension is the row."""

    tokens: torch.Tensor  # [B] the token each row feeds next
    positions: torch.Tensor  # [B, 1] its position id
    mask: torch.Tensor  # [B, 1, 1, L] additive attention mask over the static cache's columns
    uniforms: torch.Tensor  # [B, N] this call's sampling uniforms
    out_tokens: torch.Tensor  # [B, N] the tokens chosen so far
    out_logprobs: torch.Tensor  # [B, N] their logprobs
    finished: torch.Tensor  # [B] a stop token was chosen
    logits: torch.Tensor  # [B, V] the last forward's logits


class StaticDecoder:
    """One call's decode: `step()` chooses token `step` of every row from the last logits, records it, and
    feeds it through the model into the static cache; it reads nothing back to the host."""

    def __init__(
        self, model: torch.nn.Module, cfg: GenerationConfig, greedy: bool, stop_ids: list[int]
    ) -> None:
        self.model, self.cfg, self.greedy = model, cfg, greedy
        self.device = next(model.parameters()).device
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=self.device)  # the token being chosen
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # the cache column fed next
        self.graph: torch.cuda.CUDAGraph | None = None  # the step, captured for the rows' current size

    def start(
        self, left_ids: torch.Tensor, attention_mask: torch.Tensor, uniforms: torch.Tensor
    ) -> DecodeRows:
        """Prefill the prompts [B, T] into a static cache of T + max_new_tokens columns."""
        num_rows, width = left_ids.shape
        dtype, num_new = next(self.model.parameters()).dtype, self.cfg.max_new_tokens
        mask = torch.full((num_rows, 1, 1, width + num_new), torch.finfo(dtype).min, dtype=dtype)
        mask[:, 0, 0, :width].masked_fill_(attention_mask.bool().cpu(), 0.0)  # built on the host, sent once
        attention_mask = attention_mask.to(self.device)
        dynamic, logits = prefill(self.model, left_ids.to(self.device), attention_mask)
        self.cache = StaticCache(config=self.model.config, max_cache_len=width + num_new)
        for layer, filled in zip(self.cache.layers, dynamic.layers, strict=True):
            assert type(layer) is StaticLayer, type(layer)
            layer.update(filled.keys, filled.values)
        self.column.fill_(width)

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        return DecodeRows(
            tokens=zeros(num_rows),
            positions=attention_mask.sum(-1, keepdim=True),
            mask=mask.to(self.device),
            uniforms=uniforms.to(self.device),
            out_tokens=zeros(num_rows, num_new),
            out_logprobs=zeros(num_rows, num_new, dtype=torch.float32),
            finished=zeros(num_rows, dtype=torch.bool),
            logits=logits,
        )

    def choose(self, rows: DecodeRows) -> None:
        """Token `step_index` of every row, recorded with its logprob; stop tokens set `finished`."""
        uniforms = rows.uniforms.index_select(1, self.step_index).squeeze(1)  # [B]
        tokens, logprobs = choose_tokens(rows.logits, self.cfg, self.greedy, uniforms)
        rows.tokens.copy_(tokens)
        rows.out_tokens.index_copy_(1, self.step_index, tokens[:, None])
        rows.out_logprobs.index_copy_(1, self.step_index, logprobs[:, None])
        rows.finished.logical_or_((tokens[:, None] == self.stop_ids).any(-1))

    def step(self, rows: DecodeRows) -> None:
        """Choose, then feed the chosen tokens: the cache and the logits advance one position."""
        self.choose(rows)
        rows.mask.index_fill_(-1, self.column, 0.0)
        out = self.model(
            input_ids=rows.tokens[:, None],
            attention_mask=rows.mask,
            position_ids=rows.positions,
            use_cache=True,
            **cache_argument(self.model, self.cache),
        )
        rows.logits.copy_(out.logits[:, -1, :])
        rows.positions.add_(1)
        self.column.add_(1)
        self.step_index.add_(1)

    def run_step(self, rows: DecodeRows) -> None:
        """One step: on CUDA the first of a batch size runs eagerly (warming the kernels) and is captured,
        the following ones replay the graph; elsewhere eagerly."""
        if self.device.type != "cuda":
            self.step(rows)
        elif self.graph is not None:
            self.graph.replay()
        else:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.step(rows)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the step (runs nothing): the next replay is step + 1
                self.step(rows)

    def compact(self, rows: DecodeRows, keep: list[int]) -> DecodeRows:
        """Only rows `keep` stay (in the cache too); a new batch size needs a new graph."""
        index = torch.tensor(keep, device=self.device)
        self.cache.reorder_cache(index)
        self.graph = None
        return DecodeRows(*(getattr(rows, f.name).index_select(0, index) for f in fields(rows)))


@torch.inference_mode()
def static_decode_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    left_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cfg: GenerationConfig,
    greedy: bool,
    uniforms: torch.Tensor,
    sync_every: int,
) -> DecodeState:
    """decode.decode_batch's result for left-padded prompts [B, T], the host reading the finished flags
    every `sync_every` steps: then it stops when all rows finished and compacts (`compacted_size`)."""
    stop_ids = resolve_stop_token_ids(cfg, tokenizer)
    decoder = StaticDecoder(model, cfg, greedy, stop_ids)
    rows = decoder.start(left_ids, attention_mask, uniforms)
    num_samples = left_ids.shape[0]
    samples = everyone = list(range(num_samples))  # the sample of each row; every sample
    chosen_ids = torch.zeros(num_samples, cfg.max_new_tokens, dtype=torch.long)  # [B, N] on the host
    chosen_logprobs = torch.zeros(num_samples, cfg.max_new_tokens)  # [B, N]

    def take(rows: DecodeRows, indices: list[int]) -> None:  # rows `indices` to the host
        chosen_ids[[samples[j] for j in indices]] = rows.out_tokens[indices].cpu()
        chosen_logprobs[[samples[j] for j in indices]] = rows.out_logprobs[indices].cpu()

    for step in range(cfg.max_new_tokens - 1):
        decoder.run_step(rows)
        if (step + 1) % sync_every:
            continue
        finished = rows.finished.tolist()
        running = [j for j, done in enumerate(finished) if not done]
        if not running:  # every row has finished: all of them to the host
            take(rows, list(range(len(samples))))
            break
        size = compacted_size(len(samples), len(running), decoder.device.type == "cuda")
        if size is not None:
            kept = running + [j for j, done in enumerate(finished) if done][: size - len(running)]
            take(rows, [j for j in range(len(samples)) if j not in kept])
            rows, samples = decoder.compact(rows, kept), [samples[j] for j in kept]
    else:
        decoder.choose(rows)  # the last token: nothing is fed after it
        take(rows, list(range(len(samples))))
    state = DecodeState(
        [[] for _ in everyone], [[] for _ in everyone], [False] * num_samples, [False] * num_samples
    )
    for step in range(cfg.max_new_tokens):  # each sample's tokens up to its first stop token (kept)
        step_ids, step_logprobs = chosen_ids[:, step], chosen_logprobs[:, step]
        update_decode_state(
            state, everyone, step_ids, step_logprobs, set(stop_ids), [[]] * num_samples, tokenizer
        )
    return state
