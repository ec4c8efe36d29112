"""The Hugging Face backend's decoding as plain functions (no Ray): left padding, top-k / top-p filtering,
per-sample seeded sampling, a batched KV-cache decode loop with stop tokens and strings, and assembling the
outputs in the backend contract's keys.

Logprobs are those of the *unfiltered* tempered distribution, log_softmax(logits / temperature), at the chosen
token: top-k / top-p only decide which tokens may be drawn. This is what the trainer recomputes
(`policy.logprob_temperature`), so the two can be compared token by token."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.models.cache_api import cache_argument, returned_cache
from posttrain.models.moe import NOT_RECORDED, RouterTap, is_moe_model, moe_routers
from posttrain.models.vlm import concat_row_images, is_vision_language_model, vision_prefill, vision_token_ids
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.interface import sample_seed
from posttrain.workers.generation.kv_cache import reserve


def right_to_left_padded(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move right-padded prompts to the right edge: returns left-padded ids and attention mask [B, T']."""
    num_cols = int(input_lengths.max())
    shift = num_cols - input_lengths  # [B]
    source_cols = torch.arange(num_cols)[None, :] - shift[:, None]  # [B, T']
    attention_mask = source_cols >= 0  # [B, T']
    left_ids = input_ids[:, :num_cols].gather(1, source_cols.clamp(min=0))  # [B, T']
    left_ids = left_ids.masked_fill(~attention_mask, pad_id)
    return left_ids, attention_mask.long()


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. logits: [B, V], already tempered.

    Top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (the most likely token is always kept)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_from_weights(
    weights: torch.Tensor, uniforms: torch.Tensor, block: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling from unnormalised weights [B, V] (non-negative, any positive total) and uniforms
    [B] in [0, 1): the first token whose running sum exceeds u * total. Returns tokens [B] and the totals
    [B] (float64).

    The running sum is built in two levels, in float64: the sums of blocks of `block` tokens and their
    running sum pick the block, then the running sum inside that one block picks the token. That reads the
    weights once instead of converting and summing all of them in order: a full-vocabulary float64 cumsum
    took 13x the time at 64 rows of a 49k vocabulary, ~15% of a CPU decode of SmolLM2. It draws the token
    the full cumsum draws except when u * total falls within float64 rounding of a boundary (no difference
    in 12,800 draws); a token of zero probability is never drawn."""
    num_rows, num_vocab = weights.shape
    if num_vocab % block:
        weights = torch.nn.functional.pad(weights, (0, -num_vocab % block))
    padded = weights.reshape(num_rows, -1, block)  # [B, n, k]
    block_sums = padded.sum(dim=-1, dtype=torch.float64)  # [B, n]
    block_cdf = block_sums.cumsum(dim=-1)  # [B, n]
    targets = uniforms.to(block_cdf) * block_cdf[:, -1]  # [B]
    chosen = torch.searchsorted(block_cdf, targets[:, None], right=True).squeeze(-1)  # [B]
    last_nonzero = block_sums.shape[1] - 1 - (block_sums > 0).flip(-1).int().argmax(dim=-1)  # [B]
    chosen = torch.minimum(chosen, last_nonzero)  # rounding at the top end
    rows = torch.arange(num_rows, device=weights.device)
    before = block_cdf.gather(1, (chosen - 1).clamp(min=0)[:, None]).squeeze(1) * (chosen > 0)  # [B]
    inside = padded[rows, chosen]  # [B, k]
    inner_cdf = inside.double().cumsum(dim=-1) + before[:, None]  # [B, k]
    offset = torch.searchsorted(inner_cdf, targets[:, None], right=True).squeeze(-1)  # [B]
    # Rounding between the two levels may put the target past the block's own running sum.
    last_in_block = block - 1 - (inside > 0).flip(-1).int().argmax(dim=-1)  # [B]
    return chosen * block + torch.minimum(offset, last_in_block), block_cdf[:, -1]


def per_sample_uniforms(seed: int, sample_indices: list[int], num_steps: int) -> torch.Tensor:
    """Uniforms [B, num_steps] drawn from one generator per sample, seeded by (seed, its index in the whole
    batch): a sample's draws do not depend on how the batch is split across workers."""
    generators = [torch.Generator().manual_seed(sample_seed(seed, index)) for index in sample_indices]
    return torch.stack([torch.rand(num_steps, generator=g, dtype=torch.float64) for g in generators])


def choose_tokens(
    logits: torch.Tensor,
    cfg: GenerationConfig,
    greedy: bool,
    uniforms: torch.Tensor,
    banned_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row of raw logits [B, V]; return tokens [B] and their logprobs [B], those of
    the unfiltered distribution (see the module docstring), also before `banned_ids` (tokens never drawn:
    a vision-language model's image placeholders) are removed."""
    tempered = logits.float() if cfg.temperature == 1.0 else logits.float() / cfg.temperature  # [B, V]
    unfiltered = tempered
    log_total = None  # log of the tempered distribution's normaliser [B], once a path has it
    if banned_ids:
        banned = torch.tensor(banned_ids, device=logits.device)
        logits, tempered = (
            logits.index_fill(-1, banned, float("-inf")),
            tempered.index_fill(-1, banned, float("-inf")),
        )
    if greedy:
        tokens = logits.argmax(dim=-1)
    elif cfg.top_k is None and cfg.top_p >= 1.0 and not banned_ids:  # nothing filtered
        # One exp over the vocabulary gives both the sampling weights and the normaliser.
        peak = tempered.max(dim=-1).values  # [B]
        weights = (tempered - peak[:, None]).exp_()  # [B, V] unnormalised probabilities
        tokens, totals = sample_from_weights(weights, uniforms)
        log_total = peak + totals.log().float()
    else:
        probs = filter_logits(tempered, cfg.top_k, cfg.top_p).softmax(dim=-1)
        tokens = sample_from_weights(probs, uniforms)[0]
    if log_total is None:
        log_total = unfiltered.logsumexp(dim=-1)  # [B]
    return tokens, unfiltered.gather(1, tokens[:, None]).squeeze(1) - log_total


@dataclass
class DecodeState:
    """Per-sample progress of one batched decode."""

    generated_ids: list[list[int]]
    generated_logprobs: list[list[float]]
    finished: list[bool]
    stopped: list[bool]  # ended by a stop token or stop string (not by max_new_tokens)
    routed_experts: list[list[torch.Tensor]] | None = None  # MoE: per generated token, experts used [L, k]
    routing_shape: tuple[int, int] = (0, 0)  # MoE: (MoE layers L, experts per token k)


def record_routing(state: DecodeState, rows: list[int], tap: RouterTap | None) -> None:
    """After a decode step fed each row's newest token: append the experts it was routed to ([L, k] per
    MoE layer) to its sample's list, once per token (a finished row still in the batch appends nothing)."""
    if tap is None or state.routed_experts is None:
        return
    used = tap.layer_indices().cpu()  # [rows, L, k]
    tap.clear()
    for j, i in enumerate(rows):
        if len(state.routed_experts[i]) < len(state.generated_ids[i]):
            state.routed_experts[i].append(used[j])


def update_decode_state(
    state: DecodeState,
    rows: list[int],
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    stop_token_ids: set[int],
    stop_strings: list[list[str]],
    tokenizer: Any,
) -> None:
    """Append this step's token of each decoded row (sample `rows[j]`) still running; mark those that hit a
    stop token, or a stop string in the text of their newest tokens (it just completed)."""
    for i, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
        if state.finished[i]:
            continue
        state.generated_ids[i].append(token)
        state.generated_logprobs[i].append(logprob)
        hit_stop = token in stop_token_ids
        if stop_strings[i] and not hit_stop:
            # A token is at least one character (bytes: a few tokens make one).
            window = max(len(s) for s in stop_strings[i]) + 4
            text = tokenizer.decode(state.generated_ids[i][-window:], skip_special_tokens=False)
            hit_stop = any(s in text for s in stop_strings[i])
        if hit_stop:
            state.finished[i] = state.stopped[i] = True


def prefill(model: torch.nn.Module, left_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The prompts' KV cache and last-position logits [B, V], computing each distinct prompt once: the
    samples of a GRPO group share their prompt, so a group of n costs one prompt's prefill, not n."""
    # torch.unique sorts the rows; `inverse` maps each sample back to its distinct prompt.
    distinct, inverse = torch.unique(torch.cat([left_ids, attention_mask], dim=1), dim=0, return_inverse=True)
    width = left_ids.shape[1]
    distinct_ids, distinct_mask = distinct[:, :width], distinct[:, width:]
    position_ids = (distinct_mask.cumsum(-1) - 1).clamp(min=0)  # [U, T]
    out = model(
        input_ids=distinct_ids,
        attention_mask=distinct_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = returned_cache(out)
    cache.reorder_cache(inverse.to(distinct.device))  # one cache row per sample, in order
    return cache, out.logits[inverse, -1, :]


@torch.inference_mode()
def decode_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    left_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cfg: GenerationConfig,
    greedy: bool,
    uniforms: torch.Tensor,
    stop_strings: list[list[str]],
    images: dict[str, Any] | None = None,
) -> DecodeState:
    """Batched KV-cache decoding of left-padded prompts [B, T] until every sample stops or is truncated;
    `images`: per-row `pixel_values` / `image_grid_thw` lists of a vision-language model's prompts.
    Finished samples leave the batch and the cache as `compacted_size` says; one still in the batch decodes
    on, its tokens dropped. For an MoE model the state also holds the experts every generated token was
    routed to, except each sample's last token, which is never fed back (moe.RouterTap)."""
    num_samples = left_ids.shape[0]
    device = next(model.parameters()).device
    stop_token_ids = set(resolve_stop_token_ids(cfg, tokenizer))
    state = DecodeState(
        [[] for _ in range(num_samples)],
        [[] for _ in range(num_samples)],
        [False] * num_samples,
        [False] * num_samples,
        [[] for _ in range(num_samples)] if is_moe_model(model) else None,
        (len(moe_routers(model)), moe_routers(model)[0].top_k) if is_moe_model(model) else (0, 0),
    )
    attention_mask = attention_mask.to(device)
    next_positions = attention_mask.sum(-1, keepdim=True)  # [B, 1]
    if is_vision_language_model(model):
        cache, logits, offsets = vision_prefill(model, left_ids.to(device), attention_mask, images or {})
        next_positions = next_positions + offsets  # [B, 1]: M-RoPE text positions continue after the images
    elif concat_row_images(images or {}, device)[0] is not None:
        raise ValueError(f"{type(model).__name__} is a text-only model but the prompts have images")
    else:
        cache, logits = prefill(model, left_ids.to(device), attention_mask)
    cache = reserve(cache, cfg.max_new_tokens)  # decode steps write in place: no copy of the cache per step
    rows = list(range(num_samples))  # the samples of the decoded batch, in its row order
    banned_ids = vision_token_ids(model)  # a generated image placeholder would need an image behind it
    tap = RouterTap(model, keep_logits=False) if state.routed_experts is not None else None
    with tap if tap is not None else nullcontext():  # the decode steps only: prompts are not recorded
        for step in range(cfg.max_new_tokens):
            tokens, logprobs = choose_tokens(logits, cfg, greedy, uniforms[rows, step].to(device), banned_ids)
            update_decode_state(
                state, rows, tokens.cpu(), logprobs.cpu(), stop_token_ids, stop_strings, tokenizer
            )
            running = [j for j, i in enumerate(rows) if not state.finished[i]]
            if not running or step == cfg.max_new_tokens - 1:
                break
            if compacted_size(len(rows), len(running), on_cuda=False) is not None:
                keep = torch.tensor(running, device=device)
                cache.reorder_cache(keep)
                tokens, attention_mask = tokens[keep], attention_mask[keep]
                next_positions = next_positions[keep]
                rows = [rows[j] for j in running]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_positions,
                use_cache=True,
                **cache_argument(model, cache),
            )
            cache, logits = returned_cache(out), out.logits[:, -1, :]
            next_positions = next_positions + 1
            record_routing(state, rows, tap)
    return state


def compacted_size(num_rows: int, num_running: int, on_cuda: bool) -> int | None:
    """The batch size to compact a decode's rows to once some have finished, or None to keep all rows. A
    step costs a fixed part (the weights read once) plus a part per row, so a finished row kept costs its
    share of every later step, and copying the rows that stay costs about one step's attention. On CUDA
    the sizes are powers of two (a step costs about the same at any small size; each size is one graph);
    elsewhere the running rows alone, once an eighth of the batch has finished (with fewer than 8 rows, at
    once): ~log(B)/log(8/7) distinct sizes. On the long-reply benchmark's 64 rows, leaving at half cost 34%
    more row-steps than the samples needed, at an eighth 10%."""
    if on_cuda:
        size = 1 << max(num_running - 1, 0).bit_length()
        return size if size < num_rows else None
    return num_running if num_rows - num_running >= max(1, num_rows // 8) else None


def resolve_stop_token_ids(cfg: GenerationConfig, tokenizer: Any) -> list[int]:
    """The configured stop token ids, or the tokenizer's EOS when none are configured."""
    if cfg.stop_token_ids is not None:
        return list(cfg.stop_token_ids)
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]


def merge_stop_strings(
    cfg: GenerationConfig, per_sample: list[list[str] | None] | None, num_samples: int
) -> list[list[str]]:
    """Per sample: the config's stop strings plus the sample's own (empty strings are ignored)."""
    common = [s for s in cfg.stop_strings or [] if s]
    if per_sample is None:
        return [common] * num_samples
    if len(per_sample) != num_samples:
        raise ValueError(f"stop_strings: {len(per_sample)} entries for a batch of {num_samples} samples")
    return [common + [s for s in own or [] if s] for own in per_sample]


def assemble_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, state: DecodeState, pad_id: int
) -> dict[str, torch.Tensor]:
    """Prompt + generation per sample, right-padded, with the output keys of the interface."""
    generation_lengths = torch.tensor([len(ids) for ids in state.generated_ids], dtype=torch.long)  # [B]
    sequence_lengths = input_lengths.long() + generation_lengths  # [B]
    num_cols = int(sequence_lengths.max())
    output_ids = torch.full((len(sequence_lengths), num_cols), pad_id, dtype=torch.long)  # [B, T_out]
    logprobs = torch.zeros(len(sequence_lengths), num_cols, dtype=torch.float32)  # [B, T_out]
    for i, (prompt_len, total_len) in enumerate(zip(input_lengths.tolist(), sequence_lengths.tolist())):
        output_ids[i, :prompt_len] = input_ids[i, :prompt_len]
        output_ids[i, prompt_len:total_len] = torch.tensor(state.generated_ids[i], dtype=torch.long)
        logprobs[i, prompt_len:total_len] = torch.tensor(state.generated_logprobs[i], dtype=torch.float32)
    outputs = {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": sequence_lengths,
        "truncated": torch.tensor([not s for s in state.stopped], dtype=torch.bool),
    }
    if state.routed_experts is None:
        return outputs
    # The experts each generated token was routed to, at its position: [B, T_out, L, k] int16, NOT_RECORDED
    # (-1) at prompt, padding and never-fed positions.
    routed = torch.full(
        (len(sequence_lengths), num_cols, *state.routing_shape), NOT_RECORDED, dtype=torch.int16
    )
    for i, (tokens, start) in enumerate(zip(state.routed_experts, input_lengths.tolist())):
        if tokens:
            routed[i, start : start + len(tokens)] = torch.stack(tokens).to(torch.int16)
    outputs["routed_experts"] = routed
    return outputs
