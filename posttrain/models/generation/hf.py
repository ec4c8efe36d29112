"""Hugging Face generation backend: a hand-written batched KV-cache sampling loop in Ray workers.

Logprobs are those of the *unfiltered* tempered distribution, log_softmax(logits / temperature), at
the chosen token: top-k / top-p only decide which tokens may be drawn. This is what the trainer
recomputes (`policy.logprob_temperature`), so the two can be compared token by token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.shared_weights import SharedWeights, map_shared_weights
from posttrain.models.generation.config import GenerationConfig
from posttrain.models.generation.interface import RayGeneration, sample_seed
from posttrain.models.generation.kv_cache import reserve
from posttrain.models.generation.packed_linear import pack_linears
from posttrain.models.lora import AdapterWeights, apply_adapter
from posttrain.models.vlm import concat_row_images, is_vision_language_model, vision_prefill, vision_token_ids

# ----------------------------------------------------------------------------------------------------
# Pure functions: padding, filtering, sampling
# ----------------------------------------------------------------------------------------------------


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

    Top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest prefix of the
    sorted distribution whose mass reaches top_p (the most likely token is always kept).
    """
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


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [B, V] from uniforms [B] in [0, 1)."""
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    targets = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # [B]
    # Guard against rounding at the top end: never return a token of zero probability (rare: checked first).
    num_vocab = probs.shape[-1]
    tokens = tokens.clamp(max=num_vocab - 1)
    if bool((probs.gather(1, tokens[:, None]) == 0).any()):
        last_allowed = num_vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # [B]
        tokens = torch.minimum(tokens, last_allowed)
    return tokens


def per_sample_uniforms(seed: int, sample_indices: list[int], num_steps: int) -> torch.Tensor:
    """Uniforms [B, num_steps] drawn from one generator per sample, seeded by (seed, global index).

    A sample's draws depend only on the seed and its index in the whole batch, so the result does not
    depend on how the batch is split across workers.
    """
    rows = []
    for index in sample_indices:
        generator = torch.Generator().manual_seed(sample_seed(seed, index))
        rows.append(torch.rand(num_steps, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def choose_tokens(
    logits: torch.Tensor, cfg: GenerationConfig, greedy: bool, uniforms: torch.Tensor,
    banned_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row of raw logits [B, V]; return tokens [B] and their logprobs [B].

    The logprob is log_softmax(logits / temperature) at the token, before any top-k / top-p filter and
    before `banned_ids` (tokens never drawn: a vision-language model's image placeholders) are removed.
    """
    tempered = logits.float() if cfg.temperature == 1.0 else logits.float() / cfg.temperature  # [B, V]
    logprobs_all = tempered.log_softmax(dim=-1)  # [B, V]
    if banned_ids:
        banned = torch.tensor(banned_ids, device=logits.device)
        logits, tempered = logits.index_fill(-1, banned, float("-inf")), tempered.index_fill(-1, banned, float("-inf"))
    if greedy:
        tokens = logits.argmax(dim=-1)
    elif cfg.top_k is None and cfg.top_p >= 1.0 and not banned_ids:  # nothing filtered: the softmax is at hand
        tokens = sample_from_probs(logprobs_all.exp(), uniforms)
    else:
        probs = filter_logits(tempered, cfg.top_k, cfg.top_p).softmax(dim=-1)
        tokens = sample_from_probs(probs, uniforms)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def ends_with_stop_string(tokenizer: Any, generated_ids: list[int], stop_strings: list[str]) -> bool:
    """True if a stop string appears in the text of the newest generated tokens (it just completed)."""
    window = max(len(s) for s in stop_strings) + 4  # a token is at least one character (bytes: a few)
    text = tokenizer.decode(generated_ids[-window:], skip_special_tokens=False)
    return any(s in text for s in stop_strings)


# ----------------------------------------------------------------------------------------------------
# The decoding loop
# ----------------------------------------------------------------------------------------------------


@dataclass
class DecodeState:
    """Per-sample progress of one batched decode."""

    generated_ids: list[list[int]]
    generated_logprobs: list[list[float]]
    finished: list[bool]
    stopped: list[bool]  # ended by a stop token or stop string (not by max_new_tokens)


def update_decode_state(
    state: DecodeState,
    rows: list[int],
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    stop_token_ids: set[int],
    stop_strings: list[list[str]],
    tokenizer: Any,
) -> None:
    """Append this step's token of each decoded row (sample `rows[j]`) still running; mark those that
    hit a stop."""
    for i, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
        if state.finished[i]:
            continue
        state.generated_ids[i].append(token)
        state.generated_logprobs[i].append(logprob)
        hit_stop = token in stop_token_ids or (
            bool(stop_strings[i]) and ends_with_stop_string(tokenizer, state.generated_ids[i], stop_strings[i])
        )
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
    out = model(input_ids=distinct_ids, attention_mask=distinct_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1)
    out.past_key_values.reorder_cache(inverse.to(distinct.device))  # one cache row per sample, in order
    return out.past_key_values, out.logits[inverse, -1, :]


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
    """Batched KV-cache decoding of left-padded prompts [B, T] until every sample stops or is truncated.
    Finished samples leave the batch (and the cache) as it halves, so a step costs little more than the
    samples still running; a finished sample still in the batch decodes on, and its tokens are dropped.
    `images`: per-row `pixel_values` / `image_grid_thw` lists of a vision-language model's prompts."""
    num_samples = left_ids.shape[0]
    device = next(model.parameters()).device
    stop_token_ids = set(resolve_stop_token_ids(cfg, tokenizer))
    state = DecodeState([[] for _ in range(num_samples)], [[] for _ in range(num_samples)],
                        [False] * num_samples, [False] * num_samples)
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
    for step in range(cfg.max_new_tokens):
        tokens, logprobs = choose_tokens(logits, cfg, greedy, uniforms[rows, step].to(device), banned_ids)
        update_decode_state(state, rows, tokens.cpu(), logprobs.cpu(), stop_token_ids, stop_strings, tokenizer)
        running = [j for j, i in enumerate(rows) if not state.finished[i]]
        if not running or step == cfg.max_new_tokens - 1:
            break
        # Finished samples leave once half the batch has finished: a few distinct batch sizes (log2 B), not
        # one per finishing sample, which on a GPU would each cost new kernel choices.
        if len(running) <= len(rows) // 2:
            keep = torch.tensor(running, device=device)
            cache.reorder_cache(keep)
            tokens, attention_mask, next_positions = tokens[keep], attention_mask[keep], next_positions[keep]
            rows = [rows[j] for j in running]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_positions,
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_positions = next_positions + 1
    return state


def resolve_stop_token_ids(cfg: GenerationConfig, tokenizer: Any) -> list[int]:
    """The configured stop token ids, or the tokenizer's EOS when none are configured."""
    if cfg.stop_token_ids is not None:
        return list(cfg.stop_token_ids)
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]


def merge_stop_strings(cfg: GenerationConfig, per_sample: list[list[str] | None] | None, num_samples: int
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
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": sequence_lengths,
        "truncated": torch.tensor([not s for s in state.stopped], dtype=torch.bool),
    }


# ----------------------------------------------------------------------------------------------------
# Worker (one per Ray actor) and driver-side handle
# ----------------------------------------------------------------------------------------------------


def resolve_weights(weights: Any) -> dict[str, torch.Tensor]:
    """A state dict, fetching it from the object store if given a Ray ObjectRef."""
    import ray

    return ray.get(weights) if isinstance(weights, ray.ObjectRef) else weights


class HFGenerationWorker:
    """Holds one copy of the model and tokenizer and decodes shards of batches."""

    def __init__(self, cfg: GenerationConfig, model_name: str, tokenizer_name: str | None = None) -> None:
        from posttrain.models.build import load_model, load_tokenizer

        self.cfg = cfg
        from posttrain.distributed.worker_group import assigned_device

        self.device = assigned_device()
        dtype = torch.bfloat16 if cfg.precision == "bfloat16" else torch.float32
        self.model = load_model(model_name, dtype=dtype).to(self.device).eval()
        self.tokenizer = load_tokenizer(tokenizer_name or model_name)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.mapped_weights: str | None = None  # the shared-memory file the parameters view, if any
        self.repack()  # CPU fp32: weights laid out once for oneDNN, the changed ones again after each refit

    def generate(self, data: dict[str, Any], greedy: bool = False, seed: int = 0, sample_offset: int = 0
                 ) -> dict[str, torch.Tensor]:
        """Decode a shard; `sample_offset` is the global index of its first sample (seeds per sample)."""
        input_ids, input_lengths = data["input_ids"], data["input_lengths"].long().cpu()
        num_samples = input_ids.shape[0]
        self.check_context_fits(int(input_lengths.max()))
        stop_strings = merge_stop_strings(self.cfg, data.get("stop_strings"), num_samples)
        left_ids, attention_mask = right_to_left_padded(input_ids.cpu(), input_lengths, self.pad_id)
        uniforms = per_sample_uniforms(seed, list(range(sample_offset, sample_offset + num_samples)),
                                       self.cfg.max_new_tokens)
        images = {key: data[key] for key in ("pixel_values", "image_grid_thw") if key in data}
        state = decode_batch(self.model, self.tokenizer, left_ids, attention_mask, self.cfg, greedy, uniforms,
                             stop_strings, images)
        return assemble_outputs(input_ids.cpu(), input_lengths, state, self.pad_id)

    def check_context_fits(self, longest_prompt: int) -> None:
        """Fail loudly when prompt + max_new_tokens exceeds the model's position embeddings."""
        if self.max_positions is not None and longest_prompt + self.cfg.max_new_tokens > self.max_positions:
            raise ValueError(
                f"generation.max_new_tokens={self.cfg.max_new_tokens} plus the longest prompt ({longest_prompt}"
                f" tokens) exceeds the model's max_position_embeddings={self.max_positions}"
            )

    def update_weights(self, weights: Any) -> float:
        """Copy the given tensors (all or only the changed ones) into the model in place, or (LoRA) load an
        adapter onto the resident base model, and repack the changed linear layers; return seconds."""
        start = time.perf_counter()
        self.load_weights(weights)
        self.repack(force=isinstance(weights, SharedWeights))  # shared memory: the policy rewrote them all
        return time.perf_counter() - start

    def repack(self, force: bool = False) -> None:
        """Packed copies of the weights changed since the last packing (all with `force`)."""
        if self.cfg.packed_weights:
            pack_linears(self.model, force)

    def load_weights(self, weights: Any) -> None:
        if isinstance(weights, SharedWeights):
            self.map_shared_weights(weights)
            return
        state_dict = resolve_weights(weights)
        if isinstance(state_dict, AdapterWeights):  # LoRA: the adapter goes on top of the resident base
            self.model = apply_adapter(self.model, state_dict)
            return
        targets = self.model.state_dict(keep_vars=True)  # every name, tied aliases included
        unknown = sorted(set(state_dict) - set(targets))
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} names not in the generation model, e.g. {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if targets[name].shape != tensor.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(targets[name].shape)}")
                targets[name].copy_(tensor)

    def map_shared_weights(self, handle: SharedWeights) -> None:
        """Make the model's parameters views of the policy's shared-memory weights (once per file: the
        policy later rewrites them in place, so a refit costs nothing here)."""
        import ray

        if self.mapped_weights == handle.path:
            return
        if self.device.type != "cpu":
            raise ValueError("update_weights: shared-memory weights are for generation on the CPU")
        views = map_shared_weights(handle, ray.get_runtime_context().get_node_id())
        parameters = dict(self.model.named_parameters())  # a tied weight once; its alias may be in views
        missing, unknown = set(parameters) - set(views), set(views) - set(self.model.state_dict())
        if missing or unknown:
            raise KeyError(f"update_weights: shared weights lack {sorted(missing)[:5]} and have unknown "
                           f"{sorted(unknown)[:5]}")
        for name, parameter in parameters.items():
            if views[name].shape != parameter.shape or views[name].dtype != parameter.dtype:
                raise ValueError(f"update_weights: {name} is {tuple(views[name].shape)} {views[name].dtype} in "
                                 f"shared memory, the model has {tuple(parameter.shape)} {parameter.dtype}")
            parameter.data = views[name]
        self.mapped_weights = handle.path

    def prepare_for_generation(self) -> None:
        """Move the model back onto the accelerator (no-op on CPU)."""
        self.model.to(self.device)

    def finish_generation(self) -> None:
        """Move the model off the accelerator so that colocated training has the memory (no-op on CPU)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def get_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the model's tensors (all, or the named ones), for checks."""
        state_dict = self.model.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state_dict.items() if names is None or k in names}


class HFGeneration(RayGeneration):
    """Driver-side handle: data-parallel Hugging Face generation over `cfg.num_workers` Ray actors."""

    worker_cls = HFGenerationWorker
    backend_name = "hf"
