"""Typed schemas: checking a plain config against a `@dataclass` schema (keys, types, the class's
`validate()`), the schema's defaults, and writing configs and `--help-config` listings."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.errors import (
    MISSING_MARK,
    ConfigError,
    closest,
    describe_value,
    join_key,
    source_of,
    type_name,
)

T = typing.TypeVar("T")


def validate_config(
    schema_cls: type[T], cfg: DictConfig | Mapping[str, Any], sources: Mapping[str, str] | None = None
) -> T:
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


def schema_defaults(
    schema_cls: type, present: Mapping[str, Any] | None = None, instance: Any = None
) -> dict[str, Any]:
    """The defaults of a dataclass schema as a nested dict (nested dataclasses recursed, with the values
    of the section's own default instance, e.g. a `default_factory` that sets a field). An optional section
    (`X | None`, default None) gets X's defaults where the tree `present` has it. A mapping of plain values
    (`optimizer.kwargs`) is a default too, so a file that sets one of its keys keeps the others, unless the
    file changes a scalar beside it (`optimizer.name`: SGD takes other keyword arguments than AdamW's)."""
    tree: dict[str, Any] = {}
    present = present if isinstance(present, Mapping) else {}
    hints = typing.get_type_hints(schema_cls)
    values = {}
    for item in dataclasses.fields(schema_cls):
        if instance is not None:
            values[item.name] = getattr(instance, item.name)
        elif item.default is not dataclasses.MISSING:
            values[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            values[item.name] = item.default_factory()
    scalars_kept = all(
        present[name] == value
        for name, value in values.items()
        if name in present and isinstance(value, (bool, int, float, str))
    )
    for item in dataclasses.fields(schema_cls):
        if item.name not in values:
            continue  # mandatory: the file or the command line must give it
        value = values[item.name]
        optional_section = dataclass_in(hints[item.name])
        if dataclasses.is_dataclass(value):
            tree[item.name] = schema_defaults(type(value), present.get(item.name), value)
        elif value is None and optional_section and isinstance(present.get(item.name), Mapping):
            tree[item.name] = schema_defaults(optional_section, present[item.name])
        elif value is None or isinstance(value, (bool, int, float, str)):
            tree[item.name] = value
        elif isinstance(value, Mapping) and value and scalars_kept and _is_plain(value):
            tree[item.name] = config_to_dict(value)
    return tree


def _is_plain(value: Any) -> bool:
    """Scalars, and lists and mappings of them (no dataclass inside)."""
    if isinstance(value, Mapping):
        return all(_is_plain(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _schema_keys(schema_cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema, sections included (for did-you-mean suggestions)."""
    keys = []
    for item in dataclasses.fields(schema_cls):
        dotted = join_key(prefix, item.name)
        keys.append(dotted)
        section = dataclass_in(typing.get_type_hints(schema_cls)[item.name])
        if section is not None:
            keys += _schema_keys(section, dotted)
    return keys


def renamed_key(schema_cls: type, dotted: str) -> str | None:
    """The replacement of the dotted key `dotted` where a section of the schema lists it as renamed (the
    section's class attribute `RENAMED`: old name -> new name relative to the section), else None."""
    section, parts = schema_cls, dotted.split(".")
    for depth, part in enumerate(parts):
        if part in getattr(section, "RENAMED", {}):
            return ".".join([*parts[:depth], section.RENAMED[part]])
        section = dataclass_in(typing.get_type_hints(section).get(part))
        if section is None:
            return None
    return None


def dataclass_in(tp: Any) -> type | None:
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
        if tp is str and isinstance(value, os.PathLike):  # a path given as a Path: stored as its text
            return os.fspath(value)
        raise self.error(key, f"expected {type_name(tp)}, got {describe_value(value)}")

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
        raise self.error(key, f"expected {type_name(tp)}, got {describe_value(value)}")

    def convert_literal(self, tp: Any, value: Any, key: str) -> Any:
        allowed = typing.get_args(tp)
        if any(value == option and type(value) is type(option) for option in allowed):
            return value
        words = [option for option in allowed if isinstance(option, str)]
        suggestion = closest(value, words) if isinstance(value, str) else None
        raise self.error(key, f"expected {type_name(tp)}, got {describe_value(value)}", suggestion)

    def convert_sequence(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"expected {type_name(tp)}, got {describe_value(value)}")
        args = typing.get_args(tp)
        origin = typing.get_origin(tp) or tp
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise self.error(key, f"expected {type_name(tp)} ({len(args)} items), got {len(value)} items")
            return tuple(
                self.convert(arg, item, join_key(key, i)) for i, (arg, item) in enumerate(zip(args, value))
            )
        item_type = args[0] if args else Any
        items = [self.convert(item_type, item, join_key(key, i)) for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items

    def convert_mapping(self, tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, Mapping):
            raise self.error(key, f"expected {type_name(tp)}, got {describe_value(value)}")
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
            raise self.error(key, f"expected a mapping ({schema_cls.__name__}), got {describe_value(value)}")
        hints = typing.get_type_hints(schema_cls)
        fields = {item.name: item for item in dataclasses.fields(schema_cls) if item.init}
        renamed = getattr(schema_cls, "RENAMED", {})  # old name -> its replacement, relative to the section
        for name in value:
            if name in renamed:
                raise self.error(join_key(key, str(name)), f"renamed: use {join_key(key, renamed[name])}")
            if name not in fields:
                unknown = join_key(key, str(name))
                suggestion = optimizer_key(key, str(name), fields) or closest(unknown, self.all_keys)
                raise self.error(unknown, f"unknown key in {schema_cls.__name__}", suggestion)
        kwargs = {name: self.convert(hints[name], item, join_key(key, name)) for name, item in value.items()}
        for name, item in fields.items():
            if name not in kwargs and item.default is item.default_factory is dataclasses.MISSING:
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


OPTIMIZER_ARGUMENTS = {"lr": "lr", "learning_rate": "lr", "weight_decay": "weight_decay", "betas": "betas"}


def optimizer_key(key: str, name: str, fields: Mapping[str, Any]) -> str | None:
    """`policy.lr` -> `policy.optimizer.kwargs.lr`: an optimizer argument named beside an `optimizer`
    section lives in its `kwargs` mapping, which the closest-key search cannot see into."""
    if name in OPTIMIZER_ARGUMENTS and "optimizer" in fields:
        return join_key(key, f"optimizer.kwargs.{OPTIMIZER_ARGUMENTS[name]}")
    return None


def config_to_dict(instance: Any) -> Any:
    """A dataclass instance (nested ones included) as plain dicts, lists and scalars, ready for YAML."""
    if dataclasses.is_dataclass(instance) and not isinstance(instance, type):
        return {
            item.name: config_to_dict(getattr(instance, item.name)) for item in dataclasses.fields(instance)
        }
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
        section = dataclass_in(hints[item.name])
        if section is not None and isinstance(default, section):
            rows += _describe_fields(section, dotted, default)
            continue
        help_text = field_docs(schema_cls).get(item.name) or item.metadata.get("help", "")
        rows.append((dotted, _format_default(default), help_text))
        if section is not None:  # an optional section, off by default: list its keys too
            rows += _describe_fields(section, dotted, None)
    return rows


@functools.cache
def field_docs(schema_cls: type) -> dict[str, str]:
    """The help of each field of a dataclass: the docstring under the field, base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(schema_cls.__mro__[:-1]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:]):
            field_doc = isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
            if field_doc and isinstance(node.target, ast.Name) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def format_config_help(schema_cls: type) -> str:
    """The `--help-config` listing: one line per key with its default and help."""
    rows = describe_config(schema_cls)
    width = max((len(key) for key, _, _ in rows), default=0)
    return "\n".join(f"{key:<{width}}  {default:<16}  {help_text}" for key, default, help_text in rows)
