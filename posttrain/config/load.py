"""Loading: YAML files with `defaults:` inheritance, command-line overrides, `${...}` interpolation
(resolved after all merging), then the typed config of a schema."""

from __future__ import annotations

import math
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.errors import COMMAND_LINE, MISSING_MARK, ConfigError, source_of
from posttrain.config.overrides import apply_overrides, parse_overrides
from posttrain.config.schema import format_config_help, renamed_key, schema_defaults, validate_config
from posttrain.config.tree import delete_key, drop_sources, iter_leaves, pop_override_marks, record_sources

DEFAULTS_KEY = "defaults"

T = typing.TypeVar("T")


def _div(numerator: Any, denominator: Any) -> Any:
    """Exact integer division stays an int (`${div:64,8}` -> 8); anything else is a float."""
    if isinstance(numerator, int) and isinstance(denominator, int) and numerator % denominator == 0:
        return numerator // denominator
    return numerator / denominator


def register_resolvers() -> None:
    """Register `${add:..}`, `${mul:..}`, `${div:a,b}` and `${max:..}` (replacing earlier registrations)."""
    register = getattr(OmegaConf, "register_resolver", None)  # OmegaConf >= 2.4; 2.3 has only the old name
    resolvers = {
        "add": lambda *values: sum(values),
        "mul": lambda *values: math.prod(values),
        "div": _div,
        "max": lambda *values: max(values),
    }
    for name, function in resolvers.items():
        if register is not None:
            register(name, function, replace=True, annotation_validation="off")
        else:
            OmegaConf.register_new_resolver(name, function, replace=True)


register_resolvers()


@dataclass
class LoadedConfig:
    """A merged, overridden and resolved configuration with the source of every leaf."""

    cfg: DictConfig
    sources: dict[str, str]


def _read_yaml(path: str) -> dict[str, Any]:
    """One YAML file as a plain dict (interpolations and `???` kept as strings)."""
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError as error:
        raise ConfigError("", f"config file not found: {path}") from error
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError("", f"{where}: invalid YAML: {getattr(error, 'problem', error)}") from error
    if not isinstance(loaded, DictConfig):
        raise ConfigError("", f"{path}: the top level must be a mapping, got a list")
    return OmegaConf.to_container(loaded, resolve=False)  # type: ignore[return-value]


def _parent_paths(tree: dict[str, Any], path: str) -> list[str]:
    """The `defaults:` entry of a file (removed from `tree`), as paths relative to that file."""
    parents = tree.pop(DEFAULTS_KEY, [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(parent, str) for parent in parents):
        raise ConfigError(
            DEFAULTS_KEY, f"expected a file name or a list of file names, got {parents!r}", path
        )
    return [os.path.normpath(os.path.join(os.path.dirname(path), parent)) for parent in parents]


def _collect_files(path: str, chain: tuple[str, ...], files: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Add `path` and its ancestors to `files` (real path -> (shown path, own tree)) in merge order:
    parents first, left to right, each file once (a shared grandparent does not undo a sibling)."""
    real_path = os.path.realpath(path)
    if real_path in chain:
        cycle = " -> ".join([*chain[chain.index(real_path) :], real_path])
        raise ConfigError(DEFAULTS_KEY, f"inheritance cycle: {cycle}", path)
    if real_path in files:
        return
    tree = _read_yaml(path)
    for parent in _parent_paths(tree, path):
        if not os.path.exists(parent):
            raise ConfigError(DEFAULTS_KEY, f"parent config not found: {parent}", path)
        _collect_files(parent, (*chain, real_path), files)
    files[real_path] = (path, tree)


def _load_tree(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`path` merged over its parents (child wins): the plain tree and the source of every leaf."""
    files: dict[str, tuple[str, dict[str, Any]]] = {}
    _collect_files(path, (), files)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for shown_path, tree in files.values():
        for key in pop_override_marks(tree, shown_path):
            delete_key(merged, key)
            drop_sources(sources, key)
        merged = _merge(merged, tree)
        record_sources(sources, tree, shown_path)
    return merged, sources


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(update))
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


def _merge_under_defaults(defaults: dict[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` over a schema's `defaults`; a `???` in the files stays `???` (OmegaConf's merge would keep
    the default under it), so a value the files demand must still come from the command line."""
    demanded = [key for key, value in iter_leaves(tree) if isinstance(value, str) and value == MISSING_MARK]
    merged = _merge(defaults, tree)
    for key in demanded:
        *parents, name = key.split(".")
        node = merged
        for part in parents:
            node = node[part]
        node[name] = MISSING_MARK
    return merged


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    defaults: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> LoadedConfig:
    """Load `path` with its `defaults:` parents (over `defaults`, e.g. a schema's, or a function of the
    file's tree that returns them), apply command-line `overrides`, then resolve `${...}`."""
    tree, sources = _load_tree(str(path))
    if callable(defaults):
        defaults = defaults(tree)
    if defaults:
        tree = _merge_under_defaults(defaults, tree)
    cfg = OmegaConf.create(tree)
    apply_overrides(cfg, parse_overrides(overrides), sources)
    resolve_config(cfg, sources)
    return LoadedConfig(cfg, sources)


def resolve_config(cfg: DictConfig, sources: Mapping[str, str] | None = None) -> None:
    """Resolve every interpolation in place; a `???` left anywhere is an error naming its key and file."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    for key, value in iter_leaves(plain):
        if value == MISSING_MARK:
            raise ConfigError(key, "missing mandatory value (???)", source_of(key, sources))
        _resolve_leaf(cfg, key, sources)
    OmegaConf.resolve(cfg)


def _resolve_leaf(cfg: DictConfig, key: str, sources: Mapping[str, str] | None) -> None:
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
        if isinstance(value, (DictConfig, ListConfig)):
            OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(key, f"cannot resolve interpolation: {reason}", source_of(key, sources)) from None


def load_run_config(schema_cls: type[T], args: Any) -> T:
    """The validated config of `posttrain <command> --config FILE overrides...`; `--help-config` prints
    every key of the schema and exits; `--check-config` validates the config (schema and cross-section
    checks) and the files it names (the schema's `missing_files()`: data, model, reward and grader files),
    starts nothing, prints one line per problem and exits. A run stops at the first missing file."""
    if getattr(args, "help_config", False):
        print(format_config_help(schema_cls))
        sys.exit(0)
    cfg = load_typed_config(schema_cls, args.config, args.overrides)
    missing_files = getattr(cfg, "missing_files", None)  # like validate(): a schema may check its files
    problems = missing_files() if missing_files is not None else []
    if getattr(args, "check_config", False):
        for problem in problems:
            print(f"{args.config}: {problem}", file=sys.stderr)
        if problems:
            sys.exit(2)
        print(f"{args.config}: a valid {schema_cls.__name__}")
        sys.exit(0)
    if problems:
        raise problems[0]
    return cfg


def load_typed_config(schema_cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """`load_config` then `validate_config`: the typed config of a YAML file plus command-line overrides.

    The schema's defaults sit under the file, so `a.b=v` may set any key the schema knows even when the
    file does not mention it, and a file's `optimizer.kwargs: {lr: ...}` keeps the other default keyword
    arguments, as the override `policy.optimizer.kwargs.lr=...` does (mappings holding sections, such as
    `env`, and lists are not filled in: a file's `env` replaces the default one)."""
    for override in parse_overrides(overrides):
        replacement = renamed_key(schema_cls, override.key)
        if replacement is not None:
            raise ConfigError(override.key, f"renamed: use {replacement}", COMMAND_LINE)
    loaded = load_config(path, overrides, defaults=lambda tree: schema_defaults(schema_cls, tree))
    return validate_config(schema_cls, loaded.cfg, loaded.sources)
