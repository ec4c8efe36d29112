"""Loading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's own reader unpickles `.metadata` with plain `pickle` and its default planner reads non-tensor
entries (optimizer hyper-parameters) with `torch.load(weights_only=False)`: a crafted checkpoint runs
arbitrary code. Here `.metadata` goes through an unpickler that only builds DCP's metadata classes,
torch sizes/dtypes/layouts and plain paths, and non-tensor entries through `torch.load(weights_only=True)`.
Tensors were already read with `weights_only=True` by DCP itself."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA_MODULE, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to build something other than plain checkpoint data (it may run code)."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata objects; any other global (os.system, builtins.eval...) is refused."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to load {module}.{name} (only checkpoint metadata is allowed; "
            "the file may have been crafted to run code)"
        )


def read_metadata_safely(path: str | Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with `MetadataUnpickler`; raises UnsafeCheckpointError or a
    ValueError naming the file when it is not DCP metadata."""
    path = Path(path)
    with open(path, "rb") as handle:
        try:
            metadata = MetadataUnpickler(handle, str(path)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # truncated or garbage bytes: any unpickling error
            raise ValueError(
                f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})"
            ) from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `read_metadata_safely`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(self._get_metadata_path(rank))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            what = found.group(1) if found else str(exc).splitlines()[0]
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn}: refusing to load {what} (only tensors and "
                "plain data are allowed; the file may have been crafted to run code)"
            ) from None
        super().load_bytes(read_item, _saved(loaded))


def _saved(value: Any) -> io.BytesIO:
    """Re-serialise a vetted value so the parent's loader (which uses weights_only=False) only ever sees
    bytes we wrote ourselves from plain data."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
