"""Checkpoint mechanism: sharded model/optimizer state with torch.distributed.checkpoint (DCP), scheduler and
run state beside it, per-rank RNG states, and export to a Hugging Face directory.

Loading never runs code from a checkpoint: DCP metadata is unpickled by an allow-list unpickler and every
other entry is read with `torch.load(weights_only=True)` (`safe_dcp.py`); RNG states are safetensors and
the rest is JSON.

Layout of a checkpoint directory: `model/` and `optim/` (DCP), `scheduler.json`, `extra_state.json`,
`hf_config/` (the model's config.json), `tokenizer/`, `rng/rank_N.safetensors`."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from posttrain.utils.checkpoint import CheckpointWriteError
from posttrain.utils.safe_dcp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    read_metadata_safely,
)

MODEL_DIR = "model"
OPTIM_DIR = "optim"
HF_CONFIG_DIR = "hf_config"
TOKENIZER_DIR = "tokenizer"
RNG_DIR = "rng"
SCHEDULER_FILE = "scheduler.json"
EXTRA_STATE_FILE = "extra_state.json"


class CheckpointLoadError(RuntimeError):
    """A checkpoint's shards could not be read (damaged or incompatible); names the directory."""


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def on_rank0(action: Callable[[], None], what: str) -> None:
    """Run `action` on rank 0 only; every rank raises if it failed there (so no rank waits forever)."""
    failure: Exception | None = None
    error = None
    if not _is_distributed() or dist.get_rank() == 0:
        try:
            action()
        except Exception as exc:  # any failure must reach the other ranks, not only OSError
            failure, error = exc, f"{what}: {type(exc).__name__}: {exc}"
    if _is_distributed():
        message = [error]
        dist.broadcast_object_list(message, src=0)  # our own strings between our own ranks
        error = message[0]
    if error is not None:
        raise CheckpointWriteError(error) from failure


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call, which is an intended use here (reshard to 1, export)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_save(state_dict: dict[str, Any], path: Path) -> None:
    try:
        with _quiet_single_process():
            dcp.save(state_dict, checkpoint_id=path, no_dist=not _is_distributed())
    except (OSError, CheckpointException) as exc:
        raise CheckpointWriteError(f"could not write the checkpoint shard directory {path}: {exc}") from exc


def _require_dcp(path: Path) -> Path:
    """`path` if it holds DCP metadata that the allow-list unpickler accepts (checked up front, so a
    refusal is raised as itself, not wrapped in DCP's CheckpointException)."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no DCP checkpoint at {path} (missing {path / '.metadata'})")
    read_metadata_safely(path / ".metadata")
    return path


def load_dcp_into(state_dict: dict[str, Any], path: Path) -> None:
    _require_dcp(path)
    try:
        with _quiet_single_process():
            reader, no_dist = SafeFileSystemReader(path), not _is_distributed()
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:  # a BaseException: turn it into an ordinary, readable error
        causes = [failure[0] for failure in exc.failures.values()]
        unsafe = [cause for cause in causes if isinstance(cause, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from None
        summary = "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes)
        raise CheckpointLoadError(
            f"could not load the checkpoint shard directory {path}: {summary}"
        ) from None


def _write_json(data: Any, path: Path) -> None:
    try:
        text = json.dumps(data, indent=1)
    except TypeError as exc:
        raise TypeError(f"state for {path} is not JSON-serialisable: {exc}") from exc
    path.write_text(text)


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    path: str | Path,
    tokenizer: Any | None = None,
    extra_state: dict | None = None,
    trainable_only: bool = False,
) -> None:
    """Save model, optimizer (DCP, sharded as the model is) and scheduler state under `path`.

    Collective over the default process group (or a plain single process). Rank 0 also writes the
    scheduler state, `extra_state` (JSON), the model's HF config and the tokenizer. `trainable_only`
    (LoRA) saves only the parameters that train, not the frozen base weights."""
    path = Path(path)
    on_rank0(lambda: path.mkdir(parents=True, exist_ok=True), f"could not create checkpoint directory {path}")
    _dcp_save(_model_state(model, trainable_only), path / MODEL_DIR)
    if optimizer is not None:
        _dcp_save(get_optimizer_state_dict(model, optimizer), path / OPTIM_DIR)
    on_rank0(
        lambda: _write_rank0_files(model, scheduler, path, tokenizer, extra_state),
        f"could not write checkpoint files under {path}",
    )


def _write_rank0_files(
    model: torch.nn.Module, scheduler: Any | None, path: Path, tokenizer: Any | None, extra_state: dict | None
) -> None:
    if scheduler is not None:
        _write_json(scheduler.state_dict(), path / SCHEDULER_FILE)
    if extra_state is not None:
        _write_json(extra_state, path / EXTRA_STATE_FILE)
    hf_config = getattr(model, "config", None)
    if hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(path / HF_CONFIG_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(path / TOKENIZER_DIR)


def _model_state(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The sharded model state dict, or only its trainable parameters (a tied alias of a frozen weight,
    which DCP's own ignore_frozen_params keeps, is left out too)."""
    state = get_model_state_dict(model)
    if not trainable_only:
        return state
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    path: str | Path,
    trainable_only: bool = False,
) -> dict | None:
    """Restore what save_checkpoint wrote into `model`/`optimizer`/`scheduler` (collective).

    The number of ranks may differ from the save (DCP reshards). Returns the saved `extra_state` or None.
    `trainable_only` (LoRA): the checkpoint holds only the trainable parameters; the others keep their
    values (the frozen base model)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    model_state = _model_state(model, trainable_only)
    load_dcp_into(model_state, path / MODEL_DIR)
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=not trainable_only))
    if optimizer is not None and not (path / OPTIM_DIR).is_dir():
        warnings.warn(
            f"{path} holds no optimizer state (saved with save_optimizer: false); the optimizer starts fresh",
            stacklevel=2,
        )
    elif optimizer is not None:
        # A fresh optimizer gets its state initialised here, so the loaded state has somewhere to go.
        optim_state = get_optimizer_state_dict(model, optimizer)
        load_dcp_into(optim_state, path / OPTIM_DIR)
        set_optimizer_state_dict(model, optimizer, optim_state)
    if scheduler is not None:
        scheduler.load_state_dict(_read_json(path / SCHEDULER_FILE))
    extra_file = path / EXTRA_STATE_FILE
    return _read_json(extra_file) if extra_file.is_file() else None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return json.loads(path.read_text())


def _rng_file(path: str | Path, rank: int) -> Path:
    return Path(path) / RNG_DIR / f"rank_{rank}.safetensors"


def save_rng_state(path: str | Path, rank: int) -> Path:
    """Write this process's python, numpy and torch (CPU and CUDA) RNG states to
    `<path>/rng/rank_N.safetensors`."""
    file = _rng_file(path, rank)
    py_version, py_keys, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_keys, dtype=torch.int64),  # [625]
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),  # [624]
        "torch_cpu": torch.get_rng_state(),  # uint8 bytes
    }
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    scalars = {
        "python_version": py_version,
        "python_gauss": py_gauss,
        "numpy_kind": np_kind,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(file), metadata={"scalars": json.dumps(scalars)})
    except OSError as exc:
        raise CheckpointWriteError(f"could not write RNG state {file}: {exc}") from exc
    return file


def load_rng_state(path: str | Path, rank: int) -> None:
    """Restore the RNG states that save_rng_state wrote for `rank`."""
    file = _rng_file(path, rank)
    if not file.is_file():
        raise FileNotFoundError(f"no RNG state for rank {rank}: {file} is missing")
    tensors = load_file(str(file))
    with open(file, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        scalars = json.loads(json.loads(handle.read(header_size))["__metadata__"]["scalars"])
    random.setstate((scalars["python_version"], tuple(tensors["python"].tolist()), scalars["python_gauss"]))
    numpy_keys = tensors["numpy"].numpy().astype(np.uint32)
    numpy_rest = (scalars["numpy_pos"], scalars["numpy_has_gauss"], scalars["numpy_gauss"])
    np.random.set_state((scalars["numpy_kind"], numpy_keys, *numpy_rest))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if f"torch_cuda_{index}" in tensors:
                torch.cuda.set_rng_state(tensors[f"torch_cuda_{index}"], device=index)


def load_rng_state_if_saved(path: str | Path, rank: int) -> bool:
    """load_rng_state when this rank's file exists; a warning otherwise (a checkpoint of fewer ranks, or
    one written before RNG states were saved): the rank then keeps its freshly seeded RNG."""
    if not _rng_file(path, rank).is_file():
        warnings.warn(
            f"{_rng_file(path, rank)} is missing: rank {rank} keeps its seeded RNG state, so "
            "sampling-dependent steps (dropout) will not repeat the interrupted run",
            stacklevel=2,
        )
        return False
    load_rng_state(path, rank)
    return True


def auto_class(model_config: Any) -> Any:
    """The transformers auto class that loads a model of `model_config`: a sequence classifier when its
    architecture names one (a reward model), a token classifier likewise (a value model), an
    image-text-to-text model when it has a vision tower, else a causal LM."""
    import transformers

    architecture = (getattr(model_config, "architectures", None) or [""])[0]
    name = "AutoModelForCausalLM"
    if architecture.endswith(("ForSequenceClassification", "ForTokenClassification")):
        name = "AutoModelFor" + architecture.rpartition("For")[2]
    if getattr(model_config, "vision_config", None) is not None:
        name = "AutoModelForImageTextToText"
    return getattr(transformers, name)


def empty_model(model_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """An HF model of `model_config` (its `auto_class`) with uninitialised CPU weights in `dtype` (no random
    init cost)."""
    with torch.device("meta"):
        model = auto_class(model_config).from_config(model_config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty un-ties shared parameters
    return model


def weights_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype the weights were trained in: that of the first floating-point tensor."""
    return next((dtype for dtype in dtypes if dtype.is_floating_point), torch.float32)


def model_with_weights(full_state: dict[str, torch.Tensor], model_config: Any) -> torch.nn.Module:
    model = empty_model(model_config, weights_dtype([t.dtype for t in full_state.values()]))
    missing, unexpected = model.load_state_dict(full_state, strict=False)
    tied = {"lm_head.weight"} if getattr(model_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise KeyError(
            f"state dict does not match the model config: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model


def write_hf_dir(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def export_hf(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, model_config: Any) -> Path:
    """Gather the full weights on rank 0 and write a Hugging Face directory there (collective)."""
    out_dir = Path(out_dir)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state = get_model_state_dict(model, options=options)  # full on rank 0, empty on the others
    on_rank0(
        lambda: write_hf_dir(model_with_weights(full_state, model_config), tokenizer, out_dir),
        f"could not export the Hugging Face directory {out_dir}",
    )
    return out_dir


def export_checkpoint_to_hf(
    checkpoint_dir: str | Path, out_dir: str | Path, base_model_dir: str | Path | None = None
) -> Path:
    """`posttrain export`: a Hugging Face directory from a checkpoint's DCP model weights (one process).

    The model config and tokenizer come from the checkpoint (`hf_config/`, `tokenizer/`), else from
    `base_model_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    model_dir = _require_dcp(checkpoint_dir / MODEL_DIR)
    config_dir = _pick_dir(checkpoint_dir / HF_CONFIG_DIR, base_model_dir, "config")
    tokenizer_dir = _pick_dir(checkpoint_dir / TOKENIZER_DIR, base_model_dir, "tokenizer")
    saved = SafeFileSystemReader(model_dir).read_metadata().state_dict_metadata
    dtypes = [entry.properties.dtype for entry in saved.values() if hasattr(entry, "properties")]
    model = empty_model(AutoConfig.from_pretrained(config_dir), weights_dtype(dtypes))
    state = model.state_dict()  # tied weights appear under both names, sharing one tensor
    load_dcp_into(state, model_dir)
    model.load_state_dict(state)
    model.tie_weights()
    try:
        write_hf_dir(model, AutoTokenizer.from_pretrained(tokenizer_dir), out_dir)
        if (Path(tokenizer_dir) / "preprocessor_config.json").is_file():  # a vision-language model's images
            shutil.copy(
                Path(tokenizer_dir) / "preprocessor_config.json", out_dir / "preprocessor_config.json"
            )
    except OSError as exc:
        raise CheckpointWriteError(f"could not export the Hugging Face directory {out_dir}: {exc}") from exc
    return out_dir


def _pick_dir(saved: Path, base_model_dir: str | Path | None, what: str) -> str:
    if saved.is_dir():
        return str(saved)
    if base_model_dir is not None:
        return str(base_model_dir)
    raise FileNotFoundError(
        f"the checkpoint has no {what} ({saved} is missing) and no base model dir was given"
    )
