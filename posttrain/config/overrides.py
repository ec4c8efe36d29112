"""Hydra-style command-line overrides: `a.b=v` (set), `+a.c=v` (add), `++a.c=v` (force), `~a.d` (delete),
applied in order to a loaded config, with Hydra's value grammar and merge semantics.

Values: lists `[..]`, dicts `{k: v}` and quoted strings as in YAML flow syntax, but scalars follow Hydra, not
YAML 1.1: an int is decimal without a leading zero (`010`, `0x10`, `1:30` stay strings), a bool is only
`true`/`false` (`yes`, `on` are strings), `inf`, `-inf` and `nan` are floats, `null` is None. A dict set on
an existing section merges into it (the section's other keys stay); `{_override_: true, ...}` replaces it.
Hydra itself is not a dependency: hydra-core pins omegaconf < 2.4 and an antlr runtime that math-verify's
parser does not accept."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.errors import COMMAND_LINE, ConfigError, closest, describe_value, parent_key, source_of
from posttrain.config.tree import (
    drop_sources,
    iter_keys,
    lookup,
    pop_override_marks,
    record_sources,
    split_key,
)


class _ValueLoader(yaml.SafeLoader):
    """YAML flow syntax with Hydra's scalars: null, true/false, decimal ints, floats (also `1e-4`, inf, nan);
    every other plain scalar is a string."""

    yaml_implicit_resolvers: dict = {}


for _tag, _pattern, _first in (
    ("null", r"null", "nN"),
    ("bool", r"true|false", "tTfF"),
    ("int", r"[-+]?(0|[1-9][\d_]*)", "-+0123456789"),
    (
        "float",
        r"[-+]?(([\d_]*\.\d[\d_]*|\d[\d_]*\.)([eE][-+]?\d+)?|\d[\d_]*[eE][-+]?\d+|inf|nan)",
        "-+0123456789.iInN",
    ),
):
    _ValueLoader.add_implicit_resolver(
        f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?i:{_pattern})$"), list(_first)
    )


_KEY_PATTERN = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


@dataclass
class Override:
    """One command-line override: `a.b=v` (set), `+a.c=v` (add), `++a.c=v` (force) or `~a.d` (delete)."""

    kind: Literal["set", "add", "force", "delete"] = "set"
    """set: key must exist; add: must not; force: either; delete."""
    key: str = ""
    """Dotted key, e.g. policy.optimizer.kwargs.lr."""
    value: Any = None
    """The value, parsed with Hydra's grammar (None for delete)."""
    text: str = ""
    """The override as typed on the command line."""


def _parse_value(key: str, text: str) -> Any:
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_ValueLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(key, f"cannot parse value {text!r} as YAML: {error}", COMMAND_LINE) from None


def parse_override(text: str) -> Override:
    """Parse one override with the Hydra grammar (`1` int, `010` string, `[1,2]` list, `null`)."""
    kind, body = "set", text
    for prefix, prefix_kind in (("++", "force"), ("+", "add"), ("~", "delete")):
        if text.startswith(prefix):
            kind, body = prefix_kind, text[len(prefix) :]
            break
    key, has_value, value_text = body.partition("=")
    key = key.strip()
    if not _KEY_PATTERN.match(key):
        expected = "expected key=value, +key=value, ++key=value or ~key"
        raise ConfigError(key or text, f"invalid override {text!r}: {expected}", COMMAND_LINE)
    if kind == "delete":
        if has_value:
            raise ConfigError(key, f"a delete takes no value: write '~{key}'", COMMAND_LINE)
        return Override("delete", key, None, text)
    if not has_value:
        raise ConfigError(key, f"override {text!r} has no value: write '{key}=VALUE'", COMMAND_LINE)
    return Override(kind, key, _parse_value(key, value_text), text)  # type: ignore[arg-type]


def parse_overrides(texts: Sequence[str]) -> list[Override]:
    """Parse command-line overrides (`a.b=v`, `+a.c=v`, `++a.c=v`, `~a.d`) in order."""
    if isinstance(texts, str):
        raise TypeError("parse_overrides takes a list of strings, not one string")
    return [parse_override(text) for text in texts]


def apply_overrides(cfg: DictConfig, overrides: Sequence[Override], sources: dict[str, str]) -> None:
    """Apply overrides in order to `cfg` (in place), marking what they touch as set on the command line."""
    for override in overrides:
        _apply_override(cfg, override, sources)


def _apply_override(cfg: DictConfig, override: Override, sources: dict[str, str]) -> None:
    plain = OmegaConf.to_container(cfg, resolve=False)
    key = override.key
    exists, _ = lookup(plain, key)
    if override.kind in ("set", "delete") and not exists:
        verb = "set" if override.kind == "set" else "delete"
        hint = f"; use '+{key}=...' to add it" if override.kind == "set" else ""
        suggestion = closest(key, list(iter_keys(plain)))
        raise ConfigError(key, f"cannot {verb} a key that does not exist{hint}", COMMAND_LINE, suggestion)
    if override.kind == "add" and exists:
        where = source_of(key, sources) or "the config"
        use = f"use '{key}=...' to change it or '++{key}=...' to add or change"
        raise ConfigError(key, f"cannot add a key that already exists (set in {where}); {use}", COMMAND_LINE)
    _check_container_above(plain, key)
    replaced = key in pop_override_marks(override.value, COMMAND_LINE, key)
    merge = isinstance(override.value, dict) and isinstance(lookup(plain, key)[1], dict) and not replaced
    try:
        if override.kind == "delete":
            _delete_node(cfg, key)
        else:
            OmegaConf.update(cfg, key, override.value, merge=merge, force_add=True)
    except (OmegaConfBaseException, IndexError, KeyError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(key, f"cannot apply '{override.text}': {reason}", COMMAND_LINE) from None
    list_key = _enclosing_list(plain, key)
    if list_key:  # an item of a list leaf changed: the whole list now comes from the command line
        sources[list_key] = COMMAND_LINE
        return
    if not merge:
        drop_sources(sources, key)
    if override.kind != "delete":
        record_sources(sources, override.value, COMMAND_LINE, key)


def _check_container_above(tree: Any, key: str) -> None:
    """The deepest existing ancestor of `key` must be a section or a list, never a scalar to overwrite."""
    ancestor = parent_key(key)
    while ancestor and not lookup(tree, ancestor)[0]:
        ancestor = parent_key(ancestor)
    value = lookup(tree, ancestor)[1] if ancestor else tree
    if not isinstance(value, (dict, list)):
        raise ConfigError(key, f"'{ancestor}' holds {describe_value(value)}, not a section", COMMAND_LINE)


def _enclosing_list(tree: Any, key: str) -> str:
    """The dotted key of the outermost list that `key` points into ("" when it points into none)."""
    parts = split_key(key)
    for size in range(1, len(parts)):
        prefix = ".".join(parts[:size])
        if isinstance(lookup(tree, prefix)[1], list):
            return prefix
    return ""


def _delete_node(cfg: DictConfig, key: str) -> None:
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig):
        del parent[int(last)]
    else:
        del parent[last]
