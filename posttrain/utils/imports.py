"""A user's code named in a config (`path/to/file.py:name` or `package.module:name`), and sending it to Ray
actors by value."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def pickle_by_value(obj: Any) -> None:
    """Send `obj` (a user's class or function) to Ray actors by value: its module (a script, a file
    next to it, a test module) may not be importable in an actor's process. posttrain's own modules and
    `__main__` (always by value) are left alone."""
    module_name = getattr(obj, "__module__", None) or ""
    module = sys.modules.get(module_name)
    if module is None or module_name == "__main__" or module_name.split(".")[0] == "posttrain":
        return
    from ray import cloudpickle  # the copy Ray serializes actor arguments with

    cloudpickle.register_pickle_by_value(module)


def import_attribute(spec: str, kind: str = "environment") -> Any:
    """The attribute named by `path/to/file.py:name` or `package.module:name` (`kind` names it in errors)."""
    location, _, attribute = spec.rpartition(":")
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.exists():
            raise FileNotFoundError(f"{kind} file {path} (from {spec!r}) does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    if not hasattr(module, attribute):
        raise AttributeError(f"{kind} {spec!r}: {location} has no attribute {attribute!r}")
    return getattr(module, attribute)
