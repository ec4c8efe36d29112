"""LoRA through Hugging Face `peft` (the `posttrain[lora]` extra): the `policy.lora` config, wrapping the
policy model, the adapter-only payload that refit sends (`AdapterWeights`), applying it to a resident base
model (HF generation) or merging it into full weights (vLLM), adapter-only checkpoint files and exports.

Only the adapter (and `modules_to_save`) trains: the optimizer is built over trainable parameters, so it
holds their state only. The reference policy of DPO/GRPO is the same model with the adapter disabled."""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config import ConfigError
from posttrain.utils import native_checkpoint

PEFT_INSTALL_HINT = (
    "policy.lora.enabled needs Hugging Face peft: pip install 'posttrain[lora]' (or pip install peft)"
)
LORA_DIR = "lora"  # in a checkpoint's policy directory: adapter_config.json (base model and LoRA settings)
ADAPTER_DIR = "adapter"  # in an exported model directory: the PEFT adapter beside the merged weights
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy's linear layers (peft); the base weights stay frozen."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights."""
    rank: int = 8
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 16.0
    """Scaling: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Names (suffixes) of the nn.Linear modules that get adapters."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (None: the 'score' head of a reward model,
    nothing for a causal LM)."""

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError("rank", f"must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError("alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("target_modules", "name at least one module (e.g. q_proj, v_proj)")
        if self.enabled and importlib.util.find_spec("peft") is None:
            raise ConfigError("enabled", PEFT_INSTALL_HINT)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def peft_config(cfg: LoraConfig, model_kind: str = "causal_lm", base_model: str | None = None) -> Any:
    """The `peft.LoraConfig` of `cfg` (task_type None: the wrapped model's forward is the base model's)."""
    import peft

    modules_to_save = cfg.modules_to_save
    if modules_to_save is None and model_kind == "reward_model":
        modules_to_save = ["score"]  # the freshly initialised head must train
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        bias="none",
        target_modules=list(cfg.target_modules),
        modules_to_save=modules_to_save,
        base_model_name_or_path=base_model,
    )


def wrap_with_lora(
    model: torch.nn.Module, cfg: LoraConfig, model_kind: str = "causal_lm", base_model: str | None = None
) -> torch.nn.Module:
    """`model` as a peft model with fresh adapters (B = 0, so it computes what the base computes); every
    base weight frozen. Raises ConfigError naming `policy.lora.target_modules` when none matches."""
    import peft

    if base_model is not None and Path(base_model).exists():
        base_model = str(Path(base_model).resolve())  # a checkpoint exported elsewhere still finds it
        model.name_or_path = base_model  # (peft warns when the two differ)
    try:
        with warnings.catch_warnings():  # peft reads a deprecated transformers property
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, peft_config(cfg, model_kind, base_model))
    except ValueError as error:
        names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
        linear = sorted({name.rsplit(".", 1)[-1] for name in names})
        raise ConfigError(
            "policy.lora.target_modules",
            f"{cfg.target_modules} do not fit {type(model).__name__} ({error}); its linear "
            f"modules are {linear}",
        ) from None


def adapter_disabled(model: torch.nn.Module) -> Any:
    """Context manager: the base model's forward (the reference policy), adapters re-enabled afterwards."""
    return model.disable_adapter()


@dataclass
class AdapterWeights:
    """What a LoRA policy sends to generation workers: its adapter tensors in the PEFT file format
    (`base_model.model.<module>.lora_A.weight`) and the settings to rebuild the adapter on a base model."""

    cfg: LoraConfig
    model_kind: str
    tensors: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return payload_num_bytes(self.tensors)


def payload_num_bytes(weights: Any) -> int:
    """Bytes of the tensors of a refit payload (a name -> tensor dict or AdapterWeights)."""
    if isinstance(weights, AdapterWeights):
        return weights.num_bytes
    return int(sum(t.numel() * t.element_size() for t in weights.values()))


def adapter_weights(
    model: torch.nn.Module,
    trainable_state: dict[str, torch.Tensor],
    cfg: LoraConfig,
    model_kind: str,
    dtype: str | None = None,
) -> AdapterWeights:
    """The payload from a full (gathered) state dict of the trainable parameters of a peft `model`."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model, state_dict=trainable_state)
    if dtype is not None:
        target = getattr(torch, dtype)
        tensors = {name: t.to(target) if t.is_floating_point() else t for name, t in tensors.items()}
    return AdapterWeights(cfg, model_kind, tensors)


def gather_adapter_weights(
    model: torch.nn.Module, cfg: LoraConfig, model_kind: str, rank: int, dtype: str | None = None
) -> AdapterWeights | dict:
    """Collective: the full adapter tensors on rank 0 (as AdapterWeights), {} on the other ranks. Only
    the trainable shards are all-gathered, never the frozen base weights."""
    from torch.distributed.tensor import DTensor

    trainable_state = {}
    for name, param in model.named_parameters():  # the same order on every rank
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            trainable_state[name] = full.detach().to("cpu", copy=True)
    return adapter_weights(model, trainable_state, cfg, model_kind, dtype) if rank == 0 else {}


def apply_adapter(model: torch.nn.Module, adapter: AdapterWeights) -> torch.nn.Module:
    """Load the adapter onto a resident base `model` (wrapping it with peft the first time); returns the
    model to use from now on. The base weights are not touched, so every refit replaces the adapter."""
    import peft

    if not isinstance(model, peft.PeftModel):
        model = peft.get_peft_model(model, peft_config(adapter.cfg, adapter.model_kind))
        model.eval()
    result = peft.set_peft_model_state_dict(model, adapter.tensors)
    missing = [name for name in result.missing_keys if "lora_" in name]
    if result.unexpected_keys or missing:
        raise KeyError(
            f"adapter does not fit the generation model: unexpected {result.unexpected_keys[:5]}, "
            f"missing {missing[:5]}"
        )
    return model


def merge_adapter(base: dict[str, torch.Tensor], adapter: AdapterWeights) -> dict[str, torch.Tensor]:
    """The weights of `base` (HF names) that the adapter changes, merged: W + (alpha / r) * B @ A, in
    W's dtype (computed in fp32). Linear adapters only (what `target_modules` may name)."""
    prefix = "base_model.model."
    merged: dict[str, torch.Tensor] = {}
    for name, lora_a in adapter.tensors.items():
        if not name.endswith(".lora_A.weight"):
            if ".lora_B." not in name:
                raise ValueError(f"merge_adapter: cannot merge {name} (only linear LoRA adapters)")
            continue
        module = name[len(prefix) : -len(".lora_A.weight")]
        lora_b = adapter.tensors[f"{prefix}{module}.lora_B.weight"]
        weight = base[f"{module}.weight"]
        delta = adapter.cfg.scaling * (lora_b.float() @ lora_a.float())  # [out, in]
        merged[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def save_adapter_config(model: torch.nn.Module, path: str | Path) -> None:
    """`<path>/lora/adapter_config.json`: base model and LoRA settings, what an export needs (rank 0)."""
    model.peft_config["default"].save_pretrained(str(Path(path) / LORA_DIR))


def is_lora_checkpoint(policy_dir: str | Path) -> bool:
    return (Path(policy_dir) / LORA_DIR / "adapter_config.json").is_file()


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain Hugging Face model with the adapter merged into the base weights (peft's merge)."""
    return model.merge_and_unload()


def write_adapter_dir(model: torch.nn.Module, out_dir: str | Path) -> None:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) of a peft model."""
    model.save_pretrained(str(out_dir), safe_serialization=True)


def base_model_of(policy_dir: str | Path) -> str:
    """The base model a LoRA checkpoint was trained on, as recorded in its adapter config."""
    config_file = Path(policy_dir) / LORA_DIR / "adapter_config.json"
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{config_file} names no base_model_name_or_path")
    return base


def export_merged_hf(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, model_config: Any) -> Path:
    """Collective: gather the full peft model on rank 0 and write there a Hugging Face directory with the
    adapter merged into the weights, and the PEFT adapter itself in `<out_dir>/adapter/`."""
    import copy

    import peft
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out_dir = Path(out_dir)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state = get_model_state_dict(model, options=options)  # full on rank 0, empty on the others
    adapter_config = copy.deepcopy(model.peft_config["default"])

    def write() -> None:
        dtype = native_checkpoint.weights_dtype([t.dtype for t in full_state.values()])
        peft_model = peft.get_peft_model(native_checkpoint.empty_model(model_config, dtype), adapter_config)
        missing, unexpected = peft_model.load_state_dict(full_state, strict=False)
        if [name for name in missing if not name.endswith("lm_head.weight")] or unexpected:
            raise KeyError(f"LoRA export: missing {missing[:5]}, unexpected {unexpected[:5]}")
        write_adapter_dir(peft_model, out_dir / ADAPTER_DIR)
        native_checkpoint.write_hf_dir(merged_model(peft_model), tokenizer, out_dir)

    native_checkpoint.on_rank0(write, f"could not export the merged LoRA model to {out_dir}")
    return out_dir


def export_lora_checkpoint(
    policy_dir: str | Path, out_dir: str | Path, merge: bool = False, base_model_dir: str | Path | None = None
) -> Path:
    """`posttrain export` of a LoRA checkpoint of either backend (one process): a PEFT adapter directory,
    or with `merge` a Hugging Face model with the adapter merged in. The base weights come from the base
    model the checkpoint names (or `base_model_dir`); config and tokenizer from the checkpoint. The adapter
    is `lora/`'s PEFT directory (Megatron) or the DCP shards of the trainable parameters (DTensor)."""
    import shutil

    import peft
    from transformers import AutoConfig, AutoTokenizer

    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir / native_checkpoint.TOKENIZER_DIR)
    peft_dir = policy_dir / LORA_DIR
    if (peft_dir / "adapter_model.safetensors").is_file() and not merge:
        shutil.copytree(peft_dir, out_dir, dirs_exist_ok=True)
        tokenizer.save_pretrained(out_dir)
        return out_dir
    base = str(base_model_dir or base_model_of(policy_dir))
    if not Path(base).exists():
        raise FileNotFoundError(
            f"the LoRA checkpoint {policy_dir} was trained on {base}, which does not exist here; pass its "
            "directory (posttrain export --base-model DIR)"
        )
    model_config = AutoConfig.from_pretrained(policy_dir / native_checkpoint.HF_CONFIG_DIR)
    auto_class = native_checkpoint.auto_class(model_config)
    model = auto_class.from_pretrained(base, config=model_config, dtype=torch.float32)
    if (peft_dir / "adapter_model.safetensors").is_file():
        peft_model = peft.PeftModel.from_pretrained(model, str(peft_dir))
    else:
        peft_model = peft.get_peft_model(model, peft.LoraConfig.from_pretrained(str(peft_dir)))
        trainable = {name: p.detach() for name, p in peft_model.named_parameters() if p.requires_grad}
        native_checkpoint.load_dcp_into(trainable, policy_dir / native_checkpoint.MODEL_DIR)  # in place
    if merge:
        native_checkpoint.write_hf_dir(merged_model(peft_model), tokenizer, out_dir)
    else:
        write_adapter_dir(peft_model, out_dir)
        tokenizer.save_pretrained(out_dir)
    return out_dir


# -- Tensor parallelism (dtensor worker): the TP plan of a decoder layer whose projections peft wrapped --


def is_lora_linear(module: torch.nn.Module) -> bool:
    """A peft LoRA layer around an nn.Linear (`base_layer`, `lora_A`/`lora_B` ModuleDicts of nn.Linear)."""
    return (
        isinstance(getattr(module, "base_layer", None), torch.nn.Linear)
        and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), torch.nn.ModuleDict)
    )


def tensor_parallel_plan(layer: torch.nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` (module name -> ColwiseParallel/RowwiseParallel) for `layer`, with every projection that peft
    wrapped split into its base linear and its adapter so that the adapter's output is laid out like the
    base's (exact, no extra collective in the forward beyond the adapter's own):

    - column-parallel base (full input, output split over heads / MLP columns): B (out x r) is column-
      parallel too, A (r x in) stays replicated on the full input; B's input gradient is all-reduced like
      the base's, so A's gradient is complete on every TP rank.
    - row-parallel base (input split, partial sums all-reduced): A (r x in) is row-parallel (its r outputs
      are all-reduced, r numbers per token), B (out x r) stays replicated and adds to the full output.

    Layers without a peft wrapper (target_modules that leave a projection out) keep `plan`'s style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    expanded: dict[str, Any] = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if isinstance(module, torch.nn.Linear):
            expanded[name] = style
            continue
        if not is_lora_linear(module) or getattr(module, "lora_variant", None):
            raise ValueError(
                f"policy.tensor_parallel_size > 1 splits {name} ({type(module).__name__}), which must "
                "be an nn.Linear or a plain LoRA adapter around one: leave it out of "
                "policy.lora.modules_to_save"
            )
        expanded[f"{name}.base_layer"] = style
        for adapter in module.lora_A:
            if type(style) is ColwiseParallel:
                expanded[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            elif type(style) is RowwiseParallel:
                expanded[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
            else:
                raise ValueError(f"{name}: no LoRA tensor-parallel layout for {type(style).__name__}")
    return expanded
