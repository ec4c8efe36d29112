"""LoRA on the Megatron Core backend (`policy.backend: megatron` with `policy.lora.enabled`).

Each Hugging Face module that `policy.lora.target_modules` names gets its own adapter (A: r x in, B: out x r),
attached to the Megatron parallel linear that holds it: q/k/v to `linear_qkv`, o to `linear_proj`,
gate/up to `linear_fc1`, down to `linear_fc2`. So the adapter is the one peft puts on the HF model (separate
A and B per q/k/v and gate/up, the same initialisation: A uniform in +-1/sqrt(in), B = 0), sharded like its
base over tensor-parallel ranks: for a column-parallel base, A is replicated and B split by output rows (in HF
row order: each rank's rows are a contiguous block, as the base's q/k/v heads and gate/up slices are); for a
row-parallel base, A is split by input columns and B replicated. With sequence parallelism the replicated
factor sees only this rank's part of the sequence, so its gradient is summed over TP ranks (Megatron's
`sequence_parallel` parameter attribute). Converting to the PEFT file format is therefore a concatenation of
TP shards, exact, and the HF generation path (`lora.apply_adapter`) takes it unchanged.

Not peft's own Megatron support (`LoraParallelLinear`): with peft 0.21.2 and megatron-core 0.16.1 it fails to
build and to run (Megatron's parallel linears return `(output, bias)` tuples), puts one adapter on the fused
q/k/v (not HF's parametrisation), sets `params_dtype` on the shared TransformerConfig, and does not mark
replicated factors for sequence-parallel gradient reduction.

The adapter is applied by a forward hook on the base linear (the base's parameter names stay as they are);
`adapters_disabled` turns every hook off (the reference policy, no copy of weights)."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from posttrain.models import lora
from posttrain.workers.policy import megatron_convert
from posttrain.workers.policy.megatron import MegatronPolicyWorker

ADAPTER_ATTR = "lora_adapter"  # the adapter's attribute on its base linear (parameter names contain it)
PEFT_PREFIX = "base_model.model."
# Megatron linear (inside a layer) -> (HF submodule, HF modules in the order of the linear's output rows)
MEGATRON_LINEARS = {
    "self_attention.linear_qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
    "self_attention.linear_proj": ("self_attn", ["o_proj"]),
    "mlp.linear_fc1": ("mlp", ["gate_proj", "up_proj"]),
    "mlp.linear_fc2": ("mlp", ["down_proj"]),
}
ROW_PARALLEL = {"self_attention.linear_proj", "mlp.linear_fc2"}


class ParallelLinearAdapter(torch.nn.Module):
    """The adapters of the HF modules held by one Megatron parallel linear, on this TP rank: `forward(x)`
    is what they add to the base's (local) output."""

    def __init__(
        self,
        linear_name: str,
        parts: dict[str, tuple[int, int]],
        cfg: lora.LoraConfig,
        layout: megatron_convert.GPTLayout,
        tp_size: int,
        sequence_parallel: bool,
        dtype: torch.dtype,
    ) -> None:
        """`parts`: targeted HF module -> its full (out_features, in_features)."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.linear_name, self.layout, self.tp_size = linear_name, layout, tp_size
        self.row_parallel = linear_name in ROW_PARALLEL
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.scaling, self.enabled = cfg.scaling, True
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for part, (out_features, in_features) in parts.items():
            if self.row_parallel:  # A split by input columns, B replicated
                a, b = torch.zeros(cfg.rank, in_features // tp_size), torch.zeros(out_features, cfg.rank)
            else:  # A replicated, B split by output rows
                a, b = torch.zeros(cfg.rank, in_features), torch.zeros(out_features // tp_size, cfg.rank)
            self.lora_A[part] = torch.nn.Parameter(a.to(dtype))
            self.lora_B[part] = torch.nn.Parameter(b.to(dtype))
            for factor in ("lora_A", "lora_B"):
                param, dim = getattr(self, factor)[part], self.tp_dim(factor)
                if dim is not None:
                    set_tensor_model_parallel_attributes(param, True, dim, 1)
                else:  # with sequence parallelism each rank saw part of the sequence: sum its grad over TP
                    param.sequence_parallel = self.sequence_parallel

    def tp_dim(self, factor: str) -> int | None:
        """The dim along which lora_A / lora_B is split over TP ranks (None: replicated)."""
        if self.row_parallel:
            return 1 if factor == "lora_A" else None
        return 0 if factor == "lora_B" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tp

        if self.row_parallel:  # x: [s, b, in/tp] -> [s(/tp), b, out]
            (part,) = self.lora_A.keys()
            h = self.dropout(x) @ self.lora_A[part].t()  # [s, b, r], a partial sum over TP ranks
            h = (
                tp.reduce_scatter_to_sequence_parallel_region(h)
                if self.sequence_parallel
                else tp.reduce_from_tensor_model_parallel_region(h)
            )
            return (h @ self.lora_B[part].t()) * self.scaling
        outputs = {}  # x: [s(/tp), b, in] -> per part [s, b, out_part/tp]
        for part in self.lora_A.keys():
            h = self.dropout(x) @ self.lora_A[part].t()  # [s(/tp), b, r]
            h = (
                tp.gather_from_sequence_parallel_region(h)
                if self.sequence_parallel
                else tp.copy_to_tensor_model_parallel_region(h)
            )
            outputs[part] = (h @ self.lora_B[part].t()) * self.scaling
        return self._assemble(outputs)

    def _assemble(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The base's local output layout from per-part outputs (zeros for parts without an adapter)."""
        sample = next(iter(outputs.values()))
        lead = sample.shape[:-1]
        layout, tp_size = self.layout, self.tp_size

        def part(name: str, width: int) -> torch.Tensor:
            return outputs[name] if name in outputs else sample.new_zeros(*lead, width)

        if self.linear_name == "mlp.linear_fc1":  # [gate slice; up slice]
            width = layout.ffn_hidden_size // tp_size
            return torch.cat([part("gate_proj", width), part("up_proj", width)], dim=-1)
        groups = layout.num_kv_heads // tp_size  # linear_qkv: per kv group [q heads of the group, k, v]
        heads_per_group, d = layout.num_heads // layout.num_kv_heads, layout.head_dim
        q = part("q_proj", groups * heads_per_group * d).reshape(*lead, groups, heads_per_group * d)
        k = part("k_proj", groups * d).reshape(*lead, groups, d)
        v = part("v_proj", groups * d).reshape(*lead, groups, d)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)


def _add_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    adapter = getattr(module, ADAPTER_ATTR)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    result, bias = output
    return result + adapter(x).to(result.dtype), bias


def part_shapes(layout: megatron_convert.GPTLayout) -> dict[str, tuple[int, int]]:
    """Full (out, in) of every HF linear of a layer."""
    hidden, d, ffn = layout.hidden_size, layout.head_dim, layout.ffn_hidden_size
    return {
        "q_proj": (layout.num_heads * d, hidden),
        "k_proj": (layout.num_kv_heads * d, hidden),
        "v_proj": (layout.num_kv_heads * d, hidden),
        "o_proj": (hidden, layout.num_heads * d),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
    }


def hf_module_name(layer: int, linear_name: str, part: str) -> str:
    """`model.layers.<layer>.self_attn.q_proj` of a global layer index."""
    return f"model.layers.{layer}.{MEGATRON_LINEARS[linear_name][0]}.{part}"


def initial_lora_a(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """peft's initialisation of A (kaiming_uniform with a=sqrt(5): uniform in +-1/sqrt(in)), drawn from a
    generator seeded by `seed` and the HF module name, so every TP/PP layout starts from the same adapter."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / shape[1] ** 0.5
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).float()


def add_adapters(
    model: torch.nn.Module,
    cfg: lora.LoraConfig,
    layout: megatron_convert.GPTLayout,
    layer_offset: int,
    tp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    seed: int,
    dtype: torch.dtype,
) -> None:
    """Freeze every parameter of this stage's GPTModel and attach fresh adapters (B = 0) to the parallel
    linears holding a targeted HF module."""
    model.requires_grad_(False)
    shapes = part_shapes(layout)
    for index, layer in enumerate(model.decoder.layers):
        for linear_name, (_, hf_parts) in MEGATRON_LINEARS.items():
            parts = {part: shapes[part] for part in hf_parts if part in cfg.target_modules}
            if not parts:
                continue
            base = layer.get_submodule(linear_name)
            adapter = ParallelLinearAdapter(
                linear_name, parts, cfg, layout, tp_size, sequence_parallel, dtype
            )
            for part, shape in parts.items():
                full_a = initial_lora_a(
                    hf_module_name(layer_offset + index, linear_name, part), (cfg.rank, shape[1]), seed
                )
                with torch.no_grad():
                    adapter.lora_A[part].copy_(shard(full_a, adapter.tp_dim("lora_A"), tp_rank, tp_size))
            adapter.to(next(base.parameters()).device)
            setattr(base, ADAPTER_ATTR, adapter)
            base.register_forward_hook(_add_adapter_output, with_kwargs=True)


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]


def adapters(model: torch.nn.Module) -> Iterator[tuple[int, str, ParallelLinearAdapter]]:
    """(local layer index, Megatron linear name, adapter) of this stage."""
    for index, layer in enumerate(model.decoder.layers):
        for linear_name in MEGATRON_LINEARS:
            adapter = getattr(layer.get_submodule(linear_name), ADAPTER_ATTR, None)
            if adapter is not None:
                yield index, linear_name, adapter


def adapter_params(
    model: torch.nn.Module, layer_offset: int
) -> Iterator[tuple[str, int | None, torch.nn.Parameter]]:
    """(PEFT name, TP dim, parameter) of every adapter factor of this stage, in a fixed order."""
    for index, linear_name, adapter in adapters(model):
        for part in adapter.lora_A.keys():
            module = hf_module_name(layer_offset + index, linear_name, part)
            for factor in ("lora_A", "lora_B"):
                param = getattr(adapter, factor)[part]
                yield f"{PEFT_PREFIX}{module}.{factor}.weight", adapter.tp_dim(factor), param


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward (the reference policy); the adapters are re-enabled afterwards."""
    found = [adapter for _, _, adapter in adapters(model)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def write_peft_dir(adapter: lora.AdapterWeights, out_dir: str | Path, base_model: str) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) of a payload, for
    `base_model`."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if Path(base_model).exists():  # a checkpoint read from another directory still finds it
        base_model = str(Path(base_model).resolve())
    lora.peft_config(adapter.cfg, adapter.model_kind, base_model).save_pretrained(str(out_dir))
    tensors = {name: t.contiguous() for name, t in adapter.tensors.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


class MegatronLoraPolicyWorker(MegatronPolicyWorker):
    """The Megatron worker with LoRA adapters: only they train (Megatron's DDP buffers and optimizer hold
    trainable parameters only), refit and checkpoint; the reference policy is the adapters switched off."""

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        tp = (self.tp_rank, self.tp_size, self.cfg.megatron.sequence_parallel)
        dtype = self.transformer_config.params_dtype
        add_adapters(model, self.cfg.lora, self.layout, self.layer_offset, *tp, self.cfg.seed, dtype)
        return model

    def _hf_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return (
            (name, p) for name, p in self.model.module.named_parameters() if f".{ADAPTER_ATTR}." not in name
        )

    def _adapters_disabled(self) -> contextlib.AbstractContextManager:
        return adapters_disabled(self.model.module)

    def _gather_weights(self, dtype: str | None = None) -> lora.AdapterWeights | dict:
        """Collective: the full adapter in PEFT names on rank 0 (AdapterWeights), {} elsewhere."""
        tensors: dict[str, torch.Tensor] = {}
        for name, dim, param in adapter_params(self.model.module, self.layer_offset):
            shards = [param.detach()] if dim is None else self._tp_shards(param)
            tensors[name] = torch.cat(shards, dim=dim or 0).to("cpu", copy=True)
        tensors = self._stages_on_rank0(tensors)
        if self.rank != 0:
            return {}
        if dtype is not None:
            tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
        return lora.AdapterWeights(self.cfg.lora, self.cfg.model_kind, tensors)

    @torch.no_grad()
    def load_adapter(self, adapter: lora.AdapterWeights) -> None:
        """Set this rank's adapter shards from a PEFT-format adapter of the same rank and alpha (e.g. one a
        DTensor LoRA policy sent)."""
        if (adapter.cfg.rank, adapter.cfg.alpha) != (self.cfg.lora.rank, self.cfg.lora.alpha):
            raise ValueError(
                f"load_adapter: rank/alpha {adapter.cfg.rank}/{adapter.cfg.alpha} differ from "
                f"policy.lora {self.cfg.lora.rank}/{self.cfg.lora.alpha}"
            )
        for name, dim, param in adapter_params(self.model.module, self.layer_offset):
            param.copy_(shard(adapter.tensors[name], dim, self.tp_rank, self.tp_size).to(param))
        self.versions.bump()

    def export_hf(self, out_dir: str) -> None:
        """A Hugging Face directory with the adapter merged into the weights, and the PEFT adapter itself in
        `<out_dir>/adapter/` (collective)."""
        with self._backend():
            weights = self._full_weights()
            adapter = self._gather_weights(None)
        if self.rank == 0:
            weights.update(lora.merge_adapter(weights, adapter))
            write_peft_dir(adapter, Path(out_dir) / lora.ADAPTER_DIR, self.cfg.model_name)
        self._write_hf_dir(weights, out_dir)

    def _sharded_model_state(self) -> dict[str, Any]:
        """The adapter factors as ShardedTensors keyed by PEFT name (global layer index: reshardable
        across tp/pp/dp)."""
        from megatron.core.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        state = {}
        for name, dim, param in adapter_params(self.model.module, self.layer_offset):
            state[name] = (
                make_sharded_tensor_for_checkpoint(param, name)
                if dim is None
                else make_tp_sharded_tensor_for_checkpoint(param, name, tp_axis=dim)
            )
        return state

    @torch.no_grad()
    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, _, param in adapter_params(self.model.module, self.layer_offset):
            param.copy_(state[name])

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """The Megatron checkpoint of the adapter (and optimizer), plus `lora/`: the PEFT adapter directory
        naming the base model, which `posttrain export` reads (collective)."""
        with self._backend():
            adapter = self._gather_weights(None)
        if self.rank == 0:
            write_peft_dir(adapter, Path(path) / lora.LORA_DIR, self.cfg.model_name)
        super().save_checkpoint(path, save_optimizer)
