"""Checkpoint integrity: a sha256 manifest of every file, written before a checkpoint is finalized, and
its verification before a checkpoint is resumed from."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_FILE = "checksums.json"
_CHUNK = 1 << 20


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permission, a file in the way); names the path."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(directory: Path) -> list[Path]:
    """Every regular file below `directory` (relative), the manifest itself excepted."""
    files = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = (Path(root) / name).relative_to(directory)
            if relative.as_posix() != MANIFEST_FILE:
                files.append(relative)
    return sorted(files)


def write_manifest(directory: str | Path) -> Path:
    """Write `checksums.json`: {"files": {relative path: {"sha256", "size"}}} for every file below."""
    directory = Path(directory)
    files = {
        relative.as_posix(): {
            "sha256": _sha256(directory / relative),
            "size": (directory / relative).stat().st_size,
        }
        for relative in _files_under(directory)
    }
    manifest = directory / MANIFEST_FILE
    with open(manifest, "w", encoding="utf-8") as handle:
        json.dump({"version": 1, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def verify_checkpoint(directory: str | Path) -> str | None:
    """None when every file listed in the manifest is present with its size and sha256 and no file was
    added; otherwise a sentence naming what is wrong (the first problem found)."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (incomplete, or written before checksums existed)"
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        expected = {name: (entry["sha256"], int(entry["size"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        return f"{manifest_path} is not a valid manifest ({type(exc).__name__}: {exc})"
    present = {relative.as_posix() for relative in _files_under(directory)}
    missing, unlisted = sorted(expected.keys() - present), sorted(present - expected.keys())
    if missing:
        return f"{directory / missing[0]} is missing"
    if unlisted:
        return f"{directory / unlisted[0]} is not in the manifest"
    for name, (sha256, size) in sorted(expected.items()):
        actual_size = (directory / name).stat().st_size
        if actual_size != size:
            return f"{directory / name} has {actual_size} bytes, the manifest says {size} (truncated?)"
        if _sha256(directory / name) != sha256:
            return f"{directory / name} does not match its sha256 (corrupted)"
    return None
