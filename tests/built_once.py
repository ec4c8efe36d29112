"""Test-session artifacts (trained models, converted checkpoints) built once per test run and shared by
the pytest-xdist processes: the first process that asks builds the directory under a file lock, the
others wait on that lock and reuse it. The directory's name holds a hash of what makes it (the posttrain
sources, the files and settings the caller names, the torch and transformers versions), so any change to
those builds it anew."""

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "posttrain"


def build_key(settings: Iterable[object], files: Iterable[Path] = ()) -> str:
    """A hash of the posttrain sources, `files`' contents, `settings` (by repr) and the torch and
    transformers versions."""
    import torch
    import transformers

    digest = hashlib.sha256()
    for path in [*sorted(PACKAGE_DIR.rglob("*.py")), *map(Path, files)]:
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    for setting in [*settings, torch.__version__, transformers.__version__]:
        digest.update(repr(setting).encode() + b"\0")
    return digest.hexdigest()[:16]


def shared_dir(tmp_path_factory) -> Path:
    """The test run's temporary directory that every pytest-xdist process of the run shares (under xdist a
    process's own base directory is a folder of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(root: Path, name: str, key: str, build: Callable[[Path], None]) -> Path:
    """`root/<name>-<key>`, made by `build(directory)` unless a process of this run made it already. The
    build writes into a scratch directory renamed into place when it returns, so a failed build leaves
    nothing that a later caller would take for a result (it builds again and reports its own error)."""
    target = root / f"{name}-{key}"
    with open(root / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.is_dir():
            scratch = root / f"{name}-{key}.partial"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            build(scratch)
            scratch.rename(target)
    return target
