"""Fixed-size flat buckets: the unit of every weight transfer.

A model is an ordered stream of ``(name, tensor)`` (the learner exports layer by
layer). :class:`BucketPacker` groups that stream into flat 1-D buckets, one dtype
per bucket, each at most ``bucket_bytes`` (a tensor larger than that gets a
bucket of its own). It holds at most one open bucket per dtype, so the stream
never has to be materialised as a whole. The layout it produces is a
:class:`Manifest`: a pure function of the stream's (names, shapes, dtypes) and
``bucket_bytes``, so sender and receiver agree on it once the sender has sent
it once (:meth:`Manifest.to_bytes`, a few bytes per tensor).

Invariants: bucket ``i`` is a contiguous 1-D tensor of ``spec.dtype`` with
exactly ``spec.numel`` elements; entry ``e`` of it occupies elements
``[e.offset, e.offset + prod(e.shape))``; entries are in stream order and do not
overlap. :func:`unpack` returns views, never copies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

# Big enough that per-collective latency (~100 us on gloo loopback) is noise,
# small enough that two in-flight buckets stay cheap next to a model copy.
DEFAULT_BUCKET_MB = 64.0
_MB = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor inside a bucket: ``bucket[offset : offset + numel].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket's dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketSpec:
    """Layout of one flat bucket: ``numel`` elements of ``dtype``."""

    dtype: torch.dtype
    numel: int
    entries: tuple[Entry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """The bucket layout both ends of a transfer agree on."""

    buckets: tuple[BucketSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_bytes(self) -> bytes:
        """Compact JSON: per bucket its dtype, numel and ``[name, shape, offset]`` rows."""
        rows = [
            [
                str(b.dtype).removeprefix("torch."),
                b.numel,
                [[e.name, list(e.shape), e.offset] for e in b.entries],
            ]
            for b in self.buckets
        ]
        return json.dumps(rows, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        buckets = []
        for dtype_name, numel, entries in json.loads(data.decode()):
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"manifest names an unknown dtype {dtype_name!r}")
            buckets.append(
                BucketSpec(
                    dtype, int(numel), tuple(Entry(n, tuple(s), int(o)) for n, s, o in entries)
                )
            )
        return cls(tuple(buckets))

    @functools.cached_property
    def fingerprint(self) -> str:
        """Short digest of the layout; equal fingerprints mean interchangeable buckets.
        Computed once per manifest (a manifest is immutable) and kept."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]


@dataclass
class PackedModel:
    """One version of the model as flat buckets: ``buckets[i]`` follows ``manifest.buckets[i]``."""

    manifest: Manifest
    buckets: list[torch.Tensor]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return unpack(self.manifest, self.buckets)


class BucketPacker:
    """Fills flat buckets incrementally from a ``(name, tensor)`` stream.

    ``add`` keeps a reference to each tensor until its bucket closes (at most
    ``bucket_bytes`` per dtype), then copies the bucket's tensors into one
    exact-size flat buffer on ``device``: one copy per byte, no over-allocation.
    So a tensor handed to ``add`` must not be modified in place before
    :meth:`finish` returns, unless ``copy_inputs`` is set: then each tensor is
    copied to ``device`` as it arrives (for streams whose tensors are only valid
    until the next item, like an FSDP unshard; costs a second copy per byte).
    ``finish`` closes the open buckets in the order their dtypes first appeared;
    the result depends only on the stream's metadata. ``alloc(numel, dtype)`` (CPU only)
    makes each bucket's buffer (shared memory: asyncrl/transport/shm.py); default
    ``torch.empty``.
    """

    def __init__(
        self,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        device: torch.device | str = "cpu",
        copy_inputs: bool = False,
        alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * _MB)
        self.device = torch.device(device)
        self.copy_inputs = copy_inputs
        self.alloc = alloc if self.device.type == "cpu" else None
        self._open: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        self._open_numel: dict[torch.dtype, int] = {}
        self._specs: list[BucketSpec] = []
        self._buckets: list[torch.Tensor] = []
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} appears twice in the weight stream")
        self._names.add(name)
        tensor = tensor.detach()
        if self.copy_inputs:
            tensor = tensor.to(self.device, copy=True)
        dtype = tensor.dtype
        capacity = max(1, self.bucket_bytes // dtype.itemsize)
        if tensor.numel() > capacity:
            self._close([(name, tensor)], dtype)  # its own bucket; the open one stays open
            return
        if self._open_numel.get(dtype, 0) + tensor.numel() > capacity:
            self._close(self._open.pop(dtype), dtype)
            self._open_numel[dtype] = 0
        self._open.setdefault(dtype, []).append((name, tensor))
        self._open_numel[dtype] = self._open_numel.get(dtype, 0) + tensor.numel()

    def finish(self) -> PackedModel:
        for dtype, items in self._open.items():
            self._close(items, dtype)
        self._open.clear()
        return PackedModel(Manifest(tuple(self._specs)), self._buckets)

    def _close(self, items: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        entries, offset = [], 0
        for name, t in items:
            entries.append(Entry(name, tuple(t.shape), offset))
            offset += t.numel()
        if self.alloc is not None:
            flat = self.alloc(offset, dtype)
        else:
            flat = torch.empty(offset, dtype=dtype, device=self.device)
        for entry, (_, t) in zip(entries, items, strict=True):
            # view(shape).copy_ accepts non-contiguous and cross-device sources without a temp.
            flat[entry.offset : entry.offset + entry.numel].view(entry.shape).copy_(t)
        self._specs.append(BucketSpec(dtype, offset, tuple(entries)))
        self._buckets.append(flat)


def pack(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float = DEFAULT_BUCKET_MB,
    device: torch.device | str = "cpu",
    copy_inputs: bool = False,
    alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> PackedModel:
    """Consume a ``(name, tensor)`` stream (a generator is fine) into flat buckets
    (``alloc``: see :class:`BucketPacker`)."""
    packer = BucketPacker(bucket_mb, device, copy_inputs, alloc)
    for name, tensor in named_tensors:
        packer.add(name, tensor)
    return packer.finish()


def iter_unpack(
    manifest: Manifest, buckets: list[torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, view)`` for every entry, in stream order within each bucket."""
    if len(buckets) != len(manifest.buckets):
        raise ValueError(f"manifest has {len(manifest.buckets)} buckets, got {len(buckets)}")
    for spec, flat in zip(manifest.buckets, buckets, strict=True):
        if flat.dtype != spec.dtype or flat.numel() != spec.numel:
            raise ValueError(
                f"bucket is {flat.dtype}[{flat.numel()}], manifest says {spec.dtype}[{spec.numel}]"
            )
        for e in spec.entries:
            yield e.name, flat[e.offset : e.offset + e.numel].view(e.shape)


def unpack(manifest: Manifest, buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Views back into ``(name, tensor)`` with the original shapes and dtypes."""
    return list(iter_unpack(manifest, buckets))
