"""Dotted keys over plain trees of dicts and lists: walking leaves, looking keys up, deleting them, and
recording which file (or the command line) set each leaf."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from posttrain.config.errors import MISSING_MARK, ConfigError, join_key, parent_key


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


def split_key(key: str) -> list[str]:
    return key.split(".")


def lookup(tree: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in a plain tree of dicts and lists (list items by index)."""
    node = tree
    for part in split_key(key):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def drop_sources(sources: dict[str, str], key: str) -> None:
    for leaf in [leaf for leaf in sources if leaf == key or leaf.startswith(key + ".") or not key]:
        del sources[leaf]


def record_sources(sources: dict[str, str], tree: Any, source: str, prefix: str = "") -> None:
    """Mark every leaf of `tree` (placed at `prefix`) as set by `source`; a `???` never hides a value
    set before it (OmegaConf's merge keeps that value)."""
    for leaf, value in iter_leaves(tree, prefix):
        if isinstance(value, str) and value == MISSING_MARK and leaf in sources:
            continue
        drop_sources(sources, leaf)
        ancestor = parent_key(leaf)
        while ancestor:  # a list or an empty section that this leaf now lies under
            sources.pop(ancestor, None)
            ancestor = parent_key(ancestor)
        sources[leaf] = source


OVERRIDE_MARK = "_override_"


def pop_override_marks(tree: Any, path: str, prefix: str = "") -> list[str]:
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
        replaced += pop_override_marks(value, path, join_key(prefix, str(key)))
    return replaced


def delete_key(tree: dict[str, Any], key: str) -> None:
    """Delete a dotted key from a plain tree if it is there (the empty key clears the whole tree)."""
    if not key:
        tree.clear()
        return
    found, parent = lookup(tree, parent_key(key)) if "." in key else (True, tree)
    last = split_key(key)[-1]
    if found and isinstance(parent, dict):
        parent.pop(last, None)
