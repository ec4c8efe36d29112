"""Configuration: YAML files with `defaults:` inheritance, Hydra-style command-line overrides,
`${...}` interpolation (resolved after all merging) and validation into typed `@dataclass` schemas.
Every error is a `ConfigError` naming the dotted key and the file (or "command line") that set it."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

COMMAND_LINE = "command line"
MISSING_MARK = "???"
DEFAULTS_KEY = "defaults"
OVERRIDE_MARK = "_override_"


# ---------------------------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """A configuration problem, located by dotted key and the source (file or "command line")."""

    def __init__(self, key: str, message: str, source: str | None = None, suggestion: str | None = None):
        self.key = key
        self.message = message
        self.source = source
        self.suggestion = suggestion
        super().__init__(self._format())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # keeps the fields across pickling (Ray)
        return (type(self), (self.key, self.message, self.source, self.suggestion))

    @classmethod
    def at(cls, key: str, message: str) -> ConfigError:
        """An error about `key` relative to the dataclass raising it (the validator adds the section path)."""
        return cls(key, message)

    def _format(self) -> str:
        text = f"{self.key}: {self.message}" if self.key else self.message
        if self.suggestion:
            text += f"; did you mean '{self.suggestion}'?"
        if self.source:
            text += f" (from {self.source})"
        return text

    def located(self, prefix: str, sources: Mapping[str, str] | None) -> ConfigError:
        """The same error with `prefix` prepended to its key and its source looked up in `sources`."""
        key = join_key(prefix, self.key)
        source = self.source or source_of(key, sources)
        return ConfigError(key, self.message, source, self.suggestion)


def join_key(prefix: str, key: str | int) -> str:
    """`a.b` + `c` -> `a.b.c`; a list index gives `a.b[2]`."""
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix and key else (prefix or key)


def _parent_key(key: str) -> str:
    return re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", key) if ("." in key or "[" in key) else ""


def source_of(key: str, sources: Mapping[str, str] | None) -> str | None:
    """The source of `key`, of its nearest ancestor (a list leaf covers `a.b[2]`), or of a key below it."""
    if not sources:
        return None
    probe = key
    while probe:
        if probe in sources:
            return sources[probe]
        probe = _parent_key(probe)
    below = [source for leaf, source in sources.items() if leaf.startswith(key + ".")] if key else []
    return below[-1] if below else None


def closest(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate most like `name` (difflib ratio >= 0.6), for "did you mean" hints."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


# ------------------------------------------------------------------------------------------- resolvers


def _add(*values: Any) -> Any:
    return sum(values)


def _mul(*values: Any) -> Any:
    return math.prod(values)


def _div(numerator: Any, denominator: Any) -> Any:
    """Exact integer division stays an int (`${div:64,8}` -> 8); anything else is a float."""
    if isinstance(numerator, int) and isinstance(denominator, int) and numerator % denominator == 0:
        return numerator // denominator
    return numerator / denominator


def _max(*values: Any) -> Any:
    return max(values)


def register_resolvers() -> None:
    """Register `${add:..}`, `${mul:..}`, `${div:a,b}` and `${max:..}` (replacing earlier registrations)."""
    register = getattr(OmegaConf, "register_resolver", None)  # OmegaConf >= 2.4; 2.3 has only the old name
    for name, function in (("add", _add), ("mul", _mul), ("div", _div), ("max", _max)):
        if register is not None:
            register(name, function, replace=True, annotation_validation="off")
        else:
            OmegaConf.register_new_resolver(name, function, replace=True)


register_resolvers()


# ------------------------------------------------------------------------------------ plain-tree helpers


def iter_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain dict tree; lists and empty dicts are leaves."""
    if isinstance(tree, Mapping) and tree:
        for key, value in tree.items():
            yield from iter_leaves(value, join_key(prefix, str(key)))
    elif prefix:
        yield prefix, tree


def iter_keys(tree: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a plain dict tree, sections included."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            dotted = join_key(prefix, str(key))
            yield dotted
            yield from iter_keys(value, dotted)


def _split(key: str) -> list[str]:
    return key.split(".")


def _lookup(tree: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in a plain tree of dicts and lists (list items by index)."""
    node = tree
    for part in _split(key):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _drop_sources(sources: dict[str, str], key: str) -> None:
    for leaf in [leaf for leaf in sources if leaf == key or leaf.startswith(key + ".") or not key]:
        del sources[leaf]


def _record_sources(sources: dict[str, str], tree: Any, source: str, prefix: str = "") -> None:
    """Mark every leaf of `tree` (placed at `prefix`) as set by `source`; a `???` never hides a value
    set before it (OmegaConf's merge keeps that value)."""
    for leaf, value in iter_leaves(tree, prefix):
        if isinstance(value, str) and value == MISSING_MARK and leaf in sources:
            continue
        _drop_sources(sources, leaf)
        ancestor = _parent_key(leaf)
        while ancestor:  # a list or an empty section that this leaf now lies under
            sources.pop(ancestor, None)
            ancestor = _parent_key(ancestor)
        sources[leaf] = source


# --------------------------------------------------------------------------------------------- loading


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
        raise ConfigError(DEFAULTS_KEY, f"expected a file name or a list of file names, got {parents!r}", path)
    return [os.path.normpath(os.path.join(os.path.dirname(path), parent)) for parent in parents]


def _pop_override_marks(tree: Any, path: str, prefix: str = "") -> list[str]:
    """Remove every `_override_` marker from `tree`; return the keys whose sections replace the parent's."""
    if not isinstance(tree, dict):
        return []
    replaced = []
    if OVERRIDE_MARK in tree:
        mark = tree.pop(OVERRIDE_MARK)
        if not isinstance(mark, bool):
            raise ConfigError(join_key(prefix, OVERRIDE_MARK), f"expected true or false, got {mark!r}", path)
        if mark:
            replaced.append(prefix)
    for key, value in tree.items():
        replaced += _pop_override_marks(value, path, join_key(prefix, str(key)))
    return replaced


def _delete_key(tree: dict[str, Any], key: str) -> None:
    """Delete a dotted key from a plain tree if it is there (the empty key clears the whole tree)."""
    if not key:
        tree.clear()
        return
    found, parent = _lookup(tree, _parent_key(key)) if "." in key else (True, tree)
    last = _split(key)[-1]
    if found and isinstance(parent, dict):
        parent.pop(last, None)


def _collect_files(path: str, chain: tuple[str, ...], files: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Add `path` and its ancestors to `files` (real path -> (shown path, own tree)) in merge order:
    parents first, left to right, each file once (a shared grandparent does not undo a sibling)."""
    real_path = os.path.realpath(path)
    if real_path in chain:
        cycle = " -> ".join([*chain[chain.index(real_path):], real_path])
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
        for key in _pop_override_marks(tree, shown_path):
            _delete_key(merged, key)
            _drop_sources(sources, key)
        merged = _merge(merged, tree)
        _record_sources(sources, tree, shown_path)
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
        *parents, name = _split(key)
        node = merged
        for part in parents:
            node = node[part]
        node[name] = MISSING_MARK
    return merged


def load_config(path: str | Path, overrides: Sequence[str] = (),
                defaults: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> LoadedConfig:
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


# ------------------------------------------------------------------------------------------- overrides


class _ValueLoader(yaml.SafeLoader):
    """YAML 1.1 loader that also reads `1e-4` (no dot) as a float, like OmegaConf does in files."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d[\d_]*\.?[\d_]*([eE][-+]?\d+)?|\.\d[\d_]*([eE][-+]?\d+)?|\.inf|\.nan)$", re.X),
    list("-+0123456789."),
)

_KEY_PATTERN = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


@dataclass
class Override:
    """One command-line override: `a.b=v` (set), `+a.c=v` (add), `++a.c=v` (force) or `~a.d` (delete)."""

    kind: Literal["set", "add", "force", "delete"] = field(
        default="set", metadata={"help": "set: key must exist; add: must not; force: either; delete."}
    )
    key: str = field(default="", metadata={"help": "Dotted key, e.g. policy.optimizer.kwargs.lr."})
    value: Any = field(default=None, metadata={"help": "The value, parsed as YAML (None for delete)."})
    text: str = field(default="", metadata={"help": "The override as typed on the command line."})


def _parse_value(key: str, text: str) -> Any:
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_ValueLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ConfigError(key, f"cannot parse value {text!r} as YAML: {error}", COMMAND_LINE) from None


def parse_override(text: str) -> Override:
    """Parse one override with the Hydra grammar; values are YAML (`1` int, `[1,2]` list, `null`)."""
    kind = "set"
    body = text
    for prefix, prefix_kind in (("++", "force"), ("+", "add"), ("~", "delete")):
        if text.startswith(prefix):
            kind, body = prefix_kind, text[len(prefix):]
            break
    key, has_value, value_text = body.partition("=")
    key = key.strip()
    if not _KEY_PATTERN.match(key):
        raise ConfigError(key or text, f"invalid override {text!r}: expected key=value, +key=value, "
                          "++key=value or ~key", COMMAND_LINE)
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
    exists, _ = _lookup(plain, key)
    if override.kind in ("set", "delete") and not exists:
        verb = "set" if override.kind == "set" else "delete"
        hint = f"; use '+{key}=...' to add it" if override.kind == "set" else ""
        raise ConfigError(key, f"cannot {verb} a key that does not exist{hint}", COMMAND_LINE,
                          closest(key, list(iter_keys(plain))))
    if override.kind == "add" and exists:
        where = source_of(key, sources) or "the config"
        raise ConfigError(key, f"cannot add a key that already exists (set in {where}); "
                          f"use '{key}=...' to change it or '++{key}=...' to add or change", COMMAND_LINE)
    _check_container_above(plain, key)
    _pop_override_marks(override.value, COMMAND_LINE, key)  # a set always replaces: the marker is moot
    try:
        if override.kind == "delete":
            _delete_node(cfg, key)
        else:
            OmegaConf.update(cfg, key, override.value, merge=False, force_add=True)
    except (OmegaConfBaseException, IndexError, KeyError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(key, f"cannot apply '{override.text}': {reason}", COMMAND_LINE) from None
    list_key = _enclosing_list(plain, key)
    if list_key:  # an item of a list leaf changed: the whole list now comes from the command line
        sources[list_key] = COMMAND_LINE
        return
    _drop_sources(sources, key)
    if override.kind != "delete":
        _record_sources(sources, override.value, COMMAND_LINE, key)


def _check_container_above(tree: Any, key: str) -> None:
    """The deepest existing ancestor of `key` must be a section or a list, never a scalar to overwrite."""
    ancestor = _parent_key(key)
    while ancestor and not _lookup(tree, ancestor)[0]:
        ancestor = _parent_key(ancestor)
    value = _lookup(tree, ancestor)[1] if ancestor else tree
    if not isinstance(value, (dict, list)):
        raise ConfigError(key, f"'{ancestor}' holds {_describe_value(value)}, not a section", COMMAND_LINE)


def _enclosing_list(tree: Any, key: str) -> str:
    """The dotted key of the outermost list that `key` points into ("" when it points into none)."""
    parts = _split(key)
    for size in range(1, len(parts)):
        prefix = ".".join(parts[:size])
        if isinstance(_lookup(tree, prefix)[1], list):
            return prefix
    return ""


def _delete_node(cfg: DictConfig, key: str) -> None:
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig):
        del parent[int(last)]
    else:
        del parent[last]


# ------------------------------------------------------------------------------------------ validation

T = typing.TypeVar("T")


def validate_config(schema_cls: type[T], cfg: DictConfig | Mapping[str, Any],
                    sources: Mapping[str, str] | None = None) -> T:
    """Convert `cfg` into an instance of the dataclass `schema_cls`, checking keys, types and `validate()`."""
    if not (dataclasses.is_dataclass(schema_cls) and isinstance(schema_cls, type)):
        raise TypeError(f"validate_config needs a dataclass class as schema, got {schema_cls!r}")
    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[assignment]
        except OmegaConfBaseException as error:
            raise ConfigError(str(getattr(error, "full_key", "")), str(error).splitlines()[0]) from None
    checker = _Checker(schema_cls, sources)
    return checker.convert(schema_cls, cfg, "")


def load_typed_config(schema_cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """`load_config` then `validate_config`: the typed config of a YAML file plus command-line overrides.

    The schema's scalar defaults sit under the file, so `a.b=v` may set any key the schema knows even when
    the file does not mention it (open mappings and lists are not filled in: a file's `optimizer.kwargs`
    or `env` replaces the default one instead of merging into it).
    """
    loaded = load_config(path, overrides, defaults=lambda tree: schema_defaults(schema_cls, tree))
    return validate_config(schema_cls, loaded.cfg, loaded.sources)


def schema_defaults(schema_cls: type, present: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The scalar defaults of a dataclass schema as a nested dict (nested dataclasses recursed). An
    optional section (`X | None`, default None) gets X's defaults where the tree `present` has it."""
    tree: dict[str, Any] = {}
    present = present if isinstance(present, Mapping) else {}
    hints = typing.get_type_hints(schema_cls)
    for item in dataclasses.fields(schema_cls):
        if item.default is not dataclasses.MISSING:
            value = item.default
        elif item.default_factory is not dataclasses.MISSING:
            value = item.default_factory()
        else:
            continue  # mandatory: the file or the command line must give it
        optional_section = _dataclass_in(hints[item.name])
        if dataclasses.is_dataclass(value):
            tree[item.name] = schema_defaults(type(value), present.get(item.name))
        elif value is None and optional_section and isinstance(present.get(item.name), Mapping):
            tree[item.name] = schema_defaults(optional_section, present[item.name])
        elif value is None or isinstance(value, (bool, int, float, str)):
            tree[item.name] = value
    return tree


def _type_name(tp: Any) -> str:
    if tp is type(None) or tp is None:
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is not None:
        inner = ", ".join("..." if arg is Ellipsis else _type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _describe_value(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{_type_name(type(value))} {text}"


def _schema_keys(schema_cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema, sections included (for did-you-mean suggestions)."""
    keys = []
    for item in dataclasses.fields(schema_cls):
        dotted = join_key(prefix, item.name)
        keys.append(dotted)
        section = _dataclass_in(typing.get_type_hints(schema_cls)[item.name])
        if section is not None:
            keys += _schema_keys(section, dotted)
    return keys


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass of a field typed `X` or `X | None`, else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)]
        return found[0] if len(found) == 1 else None
    return None


class _Checker:
    """Recursive conversion of plain values into the schema's types, raising located ConfigErrors."""

    def __init__(self, schema_cls: type, sources: Mapping[str, str] | None):
        self.sources = sources
        self.all_keys = _schema_keys(schema_cls)

    def error(self, key: str, message: str, suggestion: str | None = None) -> ConfigError:
        return ConfigError(key, message, source_of(key, self.sources), suggestion)

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        if isinstance(value, str) and value == MISSING_MARK:
            raise self.error(key, "missing mandatory value (???)")
        if tp is Any or tp is typing.Any:
            return value
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            return self.convert_union(tp, value, key)
        if origin is Literal:
            return self.convert_literal(tp, value, key)
        if origin in (list, tuple, Sequence) or tp in (list, tuple):
            return self.convert_sequence(tp, value, key)
        if origin in (dict, Mapping) or tp is dict:
            return self.convert_mapping(tp, value, key)
        if dataclasses.is_dataclass(tp):
            return self.convert_dataclass(tp, value, key)
        return self.convert_scalar(tp, value, key)

    def convert_scalar(self, tp: Any, value: Any, key: str) -> Any:
        if tp is type(None) and value is None:
            return None
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp not in (int, float) and isinstance(tp, type) and isinstance(value, tp):
            return value
        raise self.error(key, f"expected {_type_name(tp)}, got {_describe_value(value)}")

    def convert_union(self, tp: Any, value: Any, key: str) -> Any:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        candidates = [option for option in options if option is not type(None)]
        if len(candidates) == 1:  # Optional[X]: X's own error is the most precise one
            return self.convert(candidates[0], value, key)
        for option in candidates:
            try:
                return self.convert(option, value, key)
            except ConfigError:
                continue
        raise self.error(key, f"expected {_type_name(tp)}, got {_describe_value(value)}")

    def convert_literal(self, tp: Any, value: Any, key: str) -> Any:
        allowed = typing.get_args(tp)
        if any(value == option and type(value) is type(option) for option in allowed):
            return value
        words = [option for option in allowed if isinstance(option, str)]
        suggestion = closest(value, words) if isinstance(value, str) else None
        raise self.error(key, f"expected {_type_name(tp)}, got {_describe_value(value)}", suggestion)

    def convert_sequence(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"expected {_type_name(tp)}, got {_describe_value(value)}")
        args = typing.get_args(tp)
        origin = typing.get_origin(tp) or tp
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise self.error(key, f"expected {_type_name(tp)} ({len(args)} items), got {len(value)} items")
            return tuple(self.convert(arg, item, join_key(key, i)) for i, (arg, item) in enumerate(zip(args, value)))
        item_type = args[0] if args else Any
        items = [self.convert(item_type, item, join_key(key, i)) for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items

    def convert_mapping(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, Mapping):
            raise self.error(key, f"expected {_type_name(tp)}, got {_describe_value(value)}")
        args = typing.get_args(tp)
        key_type, value_type = args if args else (Any, Any)
        converted = {}
        for name, item in value.items():
            item_key = join_key(key, str(name))
            converted[self.convert(key_type, name, item_key)] = self.convert(value_type, item, item_key)
        return converted

    def convert_dataclass(self, schema_cls: type, value: Any, key: str) -> Any:
        if isinstance(value, schema_cls):
            return value
        if not isinstance(value, Mapping):
            raise self.error(key, f"expected a mapping ({schema_cls.__name__}), got {_describe_value(value)}")
        hints = typing.get_type_hints(schema_cls)
        fields = {item.name: item for item in dataclasses.fields(schema_cls) if item.init}
        for name in value:
            if name not in fields:
                unknown = join_key(key, str(name))
                raise self.error(unknown, f"unknown key in {schema_cls.__name__}", closest(unknown, self.all_keys))
        kwargs = {name: self.convert(hints[name], item, join_key(key, name)) for name, item in value.items()}
        for name, item in fields.items():
            if name not in kwargs and _is_mandatory(item):
                raise self.error(join_key(key, name), "missing mandatory value (no default)")
        return self.build(schema_cls, kwargs, key)

    def build(self, schema_cls: type, kwargs: dict[str, Any], key: str) -> Any:
        """Instantiate and run the dataclass's own `validate()` (impossible combinations)."""
        validate: Callable[[Any], None] | None = getattr(schema_cls, "validate", None)
        try:
            instance = schema_cls(**kwargs)
            if validate is not None:
                validate(instance)
        except ConfigError as error:
            raise error.located(key, self.sources) from None
        except (ValueError, TypeError) as error:
            raise ConfigError(key, str(error), source_of(key, self.sources)) from None
        return instance


def _is_mandatory(item: dataclasses.Field) -> bool:
    return item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING


# ------------------------------------------------------------------------------------- output and help


def config_to_dict(instance: Any) -> Any:
    """A dataclass instance (nested ones included) as plain dicts, lists and scalars, ready for YAML."""
    if dataclasses.is_dataclass(instance) and not isinstance(instance, type):
        return {item.name: config_to_dict(getattr(instance, item.name)) for item in dataclasses.fields(instance)}
    if isinstance(instance, Mapping):
        return {key: config_to_dict(value) for key, value in instance.items()}
    if isinstance(instance, (list, tuple)):
        return [config_to_dict(value) for value in instance]
    if isinstance(instance, Path):
        return str(instance)
    return instance


def save_config(config: Any, path: str | Path) -> None:
    """Write a dataclass instance, a DictConfig or a dict as YAML (interpolations resolved)."""
    if isinstance(config, (DictConfig, ListConfig)):
        plain = OmegaConf.to_container(config, resolve=True)
    else:
        plain = config_to_dict(config)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(plain, handle, sort_keys=False, default_flow_style=False)


def _format_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return MISSING_MARK
    text = yaml.safe_dump(config_to_dict(value), default_flow_style=True, width=1_000_000, sort_keys=False)
    text = text.strip()
    return text.removesuffix("...").strip()


def _default_of(item: dataclasses.Field) -> Any:
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def describe_config(schema_cls: type) -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf of a schema, nested sections expanded, in order.
    A section's default instance wins over its class defaults (`field(default_factory=lambda: X(a=2))`)."""
    return _describe_fields(schema_cls, "", None)


def _describe_fields(schema_cls: type, prefix: str, instance: Any) -> list[tuple[str, str, str]]:
    rows = []
    hints = typing.get_type_hints(schema_cls)
    for item in dataclasses.fields(schema_cls):
        dotted = join_key(prefix, item.name)
        default = getattr(instance, item.name) if instance is not None else _default_of(item)
        section = _dataclass_in(hints[item.name])
        if section is not None and isinstance(default, section):
            rows += _describe_fields(section, dotted, default)
            continue
        rows.append((dotted, _format_default(default), item.metadata.get("help", "")))
        if section is not None:  # an optional section, off by default: list its keys too
            rows += _describe_fields(section, dotted, None)
    return rows


def format_config_help(schema_cls: type) -> str:
    """The `--help-config` listing: one line per key with its default and help."""
    rows = describe_config(schema_cls)
    width = max((len(key) for key, _, _ in rows), default=0)
    return "\n".join(f"{key:<{width}}  {default:<16}  {help_text}" for key, default, help_text in rows)
