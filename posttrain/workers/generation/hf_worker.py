"""The Hugging Face generation actor: one copy of the model per Ray worker, decoding shards of batches with
`decode.decode_batch` and taking refits (full weights, shared memory, or a LoRA adapter)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray
import torch

from posttrain.distributed.core_lease import LeasedThreads
from posttrain.distributed.shared_weights import SharedWeights, SharedWeightsReader, use_as_parameters
from posttrain.distributed.worker_group import assigned_device
from posttrain.models.build import load_model, load_tokenizer
from posttrain.models.lora import AdapterWeights, apply_adapter
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.decode import (
    assemble_outputs,
    decode_batch,
    merge_stop_strings,
    per_sample_uniforms,
    right_to_left_padded,
)
from posttrain.workers.generation.packed_linear import pack_linears
from posttrain.workers.generation.static_decode import static_decode_batch, use_static_loop

log = logging.getLogger(__name__)


def resolve_weights(weights: Any) -> dict[str, torch.Tensor]:
    """A state dict, fetching it from the object store if given a Ray ObjectRef."""
    return ray.get(weights) if isinstance(weights, ray.ObjectRef) else weights


def check_known(names: Any, known: Any) -> None:
    """Raise KeyError naming (up to 5 of) the `names` that are not among the generation model's `known`."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise KeyError(
            f"update_weights: {len(unknown)} names not in the generation model, e.g. {unknown[:5]}"
        )


class HFGenerationWorker:
    """Holds one copy of the model and tokenizer and decodes shards of batches."""

    reuse_process = True  # leaves no state behind in its process (RayWorkerGroup keeps it for the next)

    def __init__(self, cfg: GenerationConfig, model_name: str, tokenizer_name: str | None = None) -> None:
        self.cfg = cfg
        self.device = assigned_device()
        dtype = torch.bfloat16 if cfg.precision == "bfloat16" else torch.float32
        self.model = load_model(model_name, dtype=dtype).to(self.device).eval()
        self.tokenizer = load_tokenizer(tokenizer_name or model_name)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.shared_weights: SharedWeightsReader | None = None  # the flat buffer the parameters view, if any
        self.leased_threads: LeasedThreads | None = None  # threads borrowed from a waiting trainer
        self.static_loop_failed = False  # the static loop raised once under decode_loop auto: eager from then
        if (
            cfg.packed_weights
        ):  # CPU fp32: weights laid out once for oneDNN, the changed ones after each refit
            pack_linears(self.model)

    def generate(
        self, data: dict[str, Any], greedy: bool = False, seed: int = 0, sample_offset: int = 0
    ) -> dict[str, torch.Tensor]:
        """Decode a shard; `sample_offset` is the global index of its first sample (seeds per sample).
        With a core lease, the threads are set from it first (see distributed/core_lease.py). An optional
        `max_new_tokens` [B] in `data` lowers this call's budget (one chunk of a partial rollout)."""
        if self.leased_threads is not None:
            self.leased_threads.adjust()
        input_ids, input_lengths = data["input_ids"], data["input_lengths"].long().cpu()
        num_samples = input_ids.shape[0]
        cfg = self.cfg
        if data.get("max_new_tokens") is not None:
            cfg = dataclasses.replace(
                cfg, max_new_tokens=min(cfg.max_new_tokens, int(data["max_new_tokens"].max()))
            )
        longest = int(input_lengths.max())
        if self.max_positions is not None and longest + cfg.max_new_tokens > self.max_positions:
            raise ValueError(
                f"generation.max_new_tokens={cfg.max_new_tokens} plus the longest prompt ({longest} tokens) "
                f"exceeds the model's max_position_embeddings={self.max_positions}"
            )
        stop_strings = merge_stop_strings(cfg, data.get("stop_strings"), num_samples)
        left_ids, attention_mask = right_to_left_padded(input_ids.cpu(), input_lengths, self.pad_id)
        uniforms = per_sample_uniforms(
            seed, list(range(sample_offset, sample_offset + num_samples)), cfg.max_new_tokens
        )
        images = {key: data[key] for key in ("pixel_values", "image_grid_thw") if key in data}
        args = (self.model, self.tokenizer, left_ids, attention_mask, cfg, greedy, uniforms)
        state = None
        if not self.static_loop_failed and use_static_loop(self.model, cfg, stop_strings, bool(images)):
            state = self.try_static_loop(args, cfg)
        if state is None:
            state = decode_batch(*args, stop_strings, images)
        return assemble_outputs(input_ids.cpu(), input_lengths, state, self.pad_id)

    def try_static_loop(self, args: tuple, cfg: GenerationConfig) -> Any:
        """The static loop's result; under `decode_loop: auto` an exception in it (a CUDA-graph capture, a
        kernel) is logged once and this worker decodes eagerly from then on (None: decode eagerly now)."""
        try:
            return static_decode_batch(*args, cfg.decode_sync_every)
        except Exception as error:  # noqa: BLE001 - any failure of the fast path: take the measured one
            if cfg.decode_loop == "static":
                raise
            self.static_loop_failed = True
            log.warning(
                "the static decode loop failed (%s: %s); this generation worker decodes eagerly from now "
                "on (generation.decode_loop=eager skips the attempt)",
                type(error).__name__,
                error,
            )
            return None

    def set_core_lease(self, lease: Any, side: str, lent: int) -> None:
        """Borrow `lent` threads while `side` holds `lease` (a core_lease.CoreLease actor)."""
        self.leased_threads = LeasedThreads(lease, side, lent)

    def update_weights(self, weights: Any) -> float:
        """Copy the given tensors (all or only the changed ones) into the model in place, or (LoRA) load an
        adapter onto the resident base model, and repack the changed linear layers; return seconds."""
        start = time.perf_counter()
        self.load_weights(weights)
        if self.cfg.packed_weights:  # shared memory: the policy rewrote them all
            pack_linears(self.model, force=isinstance(weights, SharedWeights))
        return time.perf_counter() - start

    def load_weights(self, weights: Any) -> None:
        if isinstance(weights, SharedWeights):
            self.map_shared_weights(weights)
            return
        state_dict = resolve_weights(weights)
        if isinstance(state_dict, AdapterWeights):  # LoRA: the adapter goes on top of the resident base
            self.model = apply_adapter(self.model, state_dict)
            return
        targets = self.model.state_dict(keep_vars=True)  # every name, tied aliases included
        check_known(state_dict, targets)
        written = set()  # tied weights: one tensor under two names is copied once
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if id(targets[name]) in written:
                    continue
                written.add(id(targets[name]))
                if targets[name].shape != tensor.shape:
                    raise ValueError(
                        f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(targets[name].shape)}"
                    )
                targets[name].copy_(tensor)

    def map_shared_weights(self, handle: SharedWeights) -> None:
        """Make the model's parameters views of the policy's flat weight buffer, once per buffer (the policy
        rewrites it in place, so a refit costs nothing here, or on a GPU reading a file one copy)."""
        if self.shared_weights is not None and self.shared_weights.handle == handle:
            self.shared_weights.refresh()
            return
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else handle.node_id
        self.shared_weights = SharedWeightsReader(handle, node_id, self.device)
        use_as_parameters(self.model, self.shared_weights.views)

    def prepare_for_generation(self) -> None:
        """Move the model back onto the accelerator (no-op on CPU)."""
        self.model.to(self.device)

    def finish_generation(self) -> None:
        """Move the model off the accelerator so that colocated training has the memory (no-op on CPU, and
        for weights that are views of a shared flat buffer: they stay where the refit finds them)."""
        if self.device.type == "cuda" and self.shared_weights is None:
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def get_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the model's tensors (all, or the named ones), for checks."""
        state_dict = self.model.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state_dict.items() if names is None or k in names}
