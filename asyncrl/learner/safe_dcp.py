"""Loading a torch.distributed.checkpoint directory without running code from it.

torch 2.13's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load``,
and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor item (the optimizer's
hyper-parameters) with ``torch.load(weights_only=False)``: a planted pickle in either
runs whatever it asks. Here instead:

    .metadata          an unpickler that finds only DCP's metadata classes, torch sizes,
                       dtypes and layouts, and paths; anything else is refused by name
    storage files      every file the metadata names is a relative path inside the
                       directory (no absolute path, no ``..``, no symlink out)
    non-tensor items   ``torch.load(weights_only=True)`` (plain data only)
    tensor items       torch's own ``torch.load(weights_only=True)``

What is refused raises :class:`UnsafeContent`, naming the file or item and the global.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from asyncrl.storage.atomic import ManifestError, inside

METADATA = ".metadata"
WEIGHTS_ONLY_REFUSAL = "WeightsUnpickler error: "  # how torch.load's refusal names a global
_META_MODULE = "torch.distributed.checkpoint.metadata"
# What DCP's metadata pickles hold (read off a saved model + optimizer): dataclasses of
# plain fields, torch.Size, dtypes, the layout (by name) and the checkpoint id (a path).
ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_META_MODULE, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "ChunkStorageMetadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafeContent(pickle.UnpicklingError):
    """A checkpoint file asks for something outside the allow-list; nothing of it ran."""


def reason(e: BaseException) -> str:
    """One line of ``e``'s message. torch's weights-only refusal names the global on a
    line of its own, among advice to allow-list it that does not apply to a checkpoint."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in str(e).splitlines()]
    lines = [x for x in lines if x]
    for x in lines:
        if x.startswith(WEIGHTS_ONLY_REFUSAL):
            named = x[len(WEIGHTS_ONLY_REFUSAL) :].split(" was not an allowed global")[0]
            return f"refused by torch.load(weights_only=True), nothing of it ran: {named}"
    return lines[0] if lines else type(e).__name__


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, source: str):
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED_GLOBALS or dtype:
            return super().find_class(module, name)
        raise UnsafeContent(
            f"{self.source} asks for {module}.{name}, which a checkpoint's metadata never "
            f"holds: refused, nothing of it ran"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeContent(f"{self.source} holds a persistent id: refused")


def read_metadata(path: Path) -> Metadata:
    """The metadata of the DCP directory ``path`` (``path/.metadata``), read by the
    allow-listed unpickler, its storage files checked to lie inside ``path``."""
    source = path / METADATA
    with open(source, "rb") as f:
        md = _MetadataUnpickler(f, str(source)).load()
    if not isinstance(md, Metadata):
        raise UnsafeContent(f"{source} holds a {type(md).__name__}, not DCP metadata")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        try:
            inside(path, str(rel))
        except ManifestError as e:
            raise UnsafeContent(f"{source} names a storage file outside {path}: {e}") from None
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from :func:`read_metadata`."""

    # No ``**kwargs``: DCP then never falls back to per-rank metadata (asyncrl writes none).
    def read_metadata(self, *args: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata adds
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor items as plain data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeContent(f"item {fqn!r}: {reason(e)}") from None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *path, last = self.mappings[fqn]  # the item's place in the nested state dict
        node = self.original_state_dict
        for key in path:
            node = node[key]
        node[last] = obj
