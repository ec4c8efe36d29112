"""`ConfigError`, which names the dotted key and the file (or "command line") that set it, and the
helpers that locate and describe a key or a value in its message."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

COMMAND_LINE = "command line"
MISSING_MARK = "???"


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


def parent_key(key: str) -> str:
    return re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", key) if ("." in key or "[" in key) else ""


def source_of(key: str, sources: Mapping[str, str] | None) -> str | None:
    """The source of `key`, of its nearest ancestor (a list leaf covers `a.b[2]`), or of a key below it."""
    if not sources:
        return None
    probe = key
    while probe:
        if probe in sources:
            return sources[probe]
        probe = parent_key(probe)
    below = [source for leaf, source in sources.items() if leaf.startswith(key + ".")] if key else []
    return below[-1] if below else None


def closest(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate most like `name`, for "did you mean" hints: the shortest key in the same top-level
    section that ends with the same name (`policy.lr` -> `policy.optimizer.kwargs.lr`), else the closest
    spelling (difflib ratio >= 0.6)."""
    section, last = name.partition(".")[0], name.rpartition(".")[2]
    nested = [c for c in candidates if c.startswith(section + ".") and c.endswith("." + last) and c != name]
    if "." in name and nested:
        return min(nested, key=len)
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def type_name(tp: Any) -> str:
    if tp is type(None) or tp is None:
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None:
        inner = ", ".join("..." if arg is Ellipsis else type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def describe_value(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type_name(type(value))} {text}"
