"""GGUF files as models: a `.gguf` model name is dequantized once, through transformers' own GGUF loader, into
a plain fp32 Hugging Face directory (weights, config, tokenizer, chat template) that every path then loads."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from posttrain.config import ConfigError

EXTRA_HINT = "pip install 'posttrain[gguf]' (the gguf and accelerate packages)"


def is_gguf(model_name: str | os.PathLike | None) -> bool:
    return model_name is not None and str(model_name).lower().endswith(".gguf")


def default_cache_dir(gguf_file: Path) -> Path:
    """`<file>.hf/` in a writable folder, else `~/.cache/posttrain/gguf/<name>-<size>-<mtime>-<hash>/`."""
    if os.access(gguf_file.parent, os.W_OK):
        return gguf_file.with_name(gguf_file.name + ".hf")
    stat = gguf_file.stat()
    key = hashlib.sha1(str(gguf_file.resolve()).encode()).hexdigest()[:8]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "posttrain" / "gguf"
    return base / f"{gguf_file.stem}-{stat.st_size}-{int(stat.st_mtime)}-{key}"


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, key: str = "model_name") -> Path:
    """Dequantize `gguf_file` to fp32 and save it with its tokenizer as a normal directory in `out_dir`.

    transformers flags a model loaded from GGUF as quantized and refuses to save it, so a plain model is
    built from the same config without `quantization_config` and given the dequantized state dict."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError as error:
            raise ConfigError(
                key, f"{gguf_file} is a GGUF file, which needs the '{package}' package: {EXTRA_HINT}"
            ) from error
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ConfigError(key, f"transformers cannot dequantize {gguf_file}: {error}") from error
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k not in tied_weight_names(plain)]:
        problem = (
            f"weights do not fit {type(loaded).__name__} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
        raise ConfigError(key, f"{gguf_file}: {problem}")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(out_dir)  # a crash never leaves a half-written directory that looks finished
    return out_dir


def tied_weight_names(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys if isinstance(keys, (list, set, tuple)) else keys.keys())


def gguf_model_dir(
    model_name: str | os.PathLike, key: str = "policy.model_name", cache_dir: str | os.PathLike | None = None
) -> str:
    """The plain directory of a `.gguf` model name (converted on first use, then reused); any other name
    is returned unchanged. Errors name `key`, the config key that gave the name."""
    if not is_gguf(model_name):
        return str(model_name)
    gguf_file = Path(model_name)
    if not gguf_file.is_file():
        raise ConfigError(key, f"GGUF file {gguf_file} does not exist")
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(gguf_file)
    if not (out_dir / "config.json").is_file():
        print(f"dequantizing {gguf_file} to fp32 into {out_dir} (once)")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_file, out_dir, key)
    return str(out_dir)


def main(args) -> int:
    """`posttrain convert-gguf FILE OUT_DIR`."""
    out_dir = Path(args.out_dir)
    if (out_dir / "config.json").is_file():
        print(f"{out_dir} already holds a model; nothing to do")
        return 0
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(args.gguf_file, out_dir)
    print(
        f"converted {args.gguf_file} -> {out_dir} (fp32; load it with AutoModelForCausalLM.from_pretrained)"
    )
    return 0
