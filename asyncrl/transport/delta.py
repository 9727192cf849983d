"""Lossless partial updates, decided per bucket, and the shadows they need.

Three modes (:class:`Mode`):

* ``full``: every bucket goes dense.
* ``changed_buckets``: a bucket whose bytes equal those of the receiver's
  version is skipped; any other goes dense.
* ``sparse_delta``: a changed bucket sends only the elements whose stored bit
  pattern changed, as ``(indices, values)``; when that payload would not be
  smaller than the dense bucket it goes dense instead.

Both partial modes need the exact bytes the receiver holds. The sender keeps
them in a :class:`ShadowStore` (one :class:`PackedModel` per version some
receiver may still hold). Why exact copies rather than per-bucket digests:
``sparse_delta`` needs the old elements anyway, an exact compare
(``torch.equal`` on integer views, memory-bound) is as fast as a good hash and
can never collide, and a digest-only scheme would still need a strong hash
(sha256/blake2 run at ~1 GB/s per core, slower than the compare). The cost is
memory: ``model_bytes`` per retained version, minus buckets identical to the
previous version, which are stored once (frozen parameters cost nothing extra).
Bound it with ``max_versions`` and :meth:`ShadowStore.retain` (the broker knows
which versions receivers still hold).

Bits, not values: every comparison views the bucket as a same-width integer, so
``-0.0`` vs ``0.0`` and NaN payloads count as changes and round-trip exactly.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

import torch

from asyncrl.transport.buckets import PackedModel

# Sparse index dtype: int32 halves the index bytes and covers any bucket below 2**31 elements.
_INT32_LIMIT = 2**31
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Mode(enum.StrEnum):
    FULL = "full"
    CHANGED = "changed_buckets"
    SPARSE = "sparse_delta"


class Kind(enum.IntEnum):
    """What goes on the wire for one bucket."""

    SKIP = 0
    DENSE = 1
    SPARSE = 2


@dataclass(frozen=True)
class BucketPlan:
    """``nnz`` = changed elements (SPARSE only); ``nbytes`` = payload bytes on the wire."""

    kind: Kind
    nnz: int
    nbytes: int


def bits(flat: torch.Tensor) -> torch.Tensor:
    """Same storage, viewed as a same-width integer (bool/fp8 → uint8, bf16 → int16, ...)."""
    size = flat.dtype.itemsize
    if size not in _BITS_DTYPE:
        raise TypeError(f"no integer view for {flat.dtype} ({size} bytes)")
    return flat.view(_BITS_DTYPE[size])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


def sparse_nbytes(nnz: int, numel: int, itemsize: int) -> int:
    """Wire size of a sparse payload: indices then values, both flat."""
    return nnz * (index_dtype(numel).itemsize + itemsize)


def same_bits(new: torch.Tensor, base: torch.Tensor) -> bool:
    return new is base or torch.equal(bits(new), bits(base))


def plan_bucket(mode: Mode, new: torch.Tensor, base: torch.Tensor | None) -> BucketPlan:
    """Decide how bucket ``new`` reaches a receiver holding ``base`` (None: holds nothing)."""
    dense = BucketPlan(Kind.DENSE, 0, new.numel() * new.dtype.itemsize)
    if mode is Mode.FULL or base is None:
        return dense
    if same_bits(new, base):
        return BucketPlan(Kind.SKIP, 0, 0)
    if mode is Mode.CHANGED or new.dtype.itemsize not in _BITS_DTYPE:
        return dense
    nnz = int(torch.count_nonzero(bits(new) != bits(base)))
    nbytes = sparse_nbytes(nnz, new.numel(), new.dtype.itemsize)
    # Ties go dense: same bytes, and the receiver then needs no scatter.
    return BucketPlan(Kind.SPARSE, nnz, nbytes) if nbytes < dense.nbytes else dense


def encode_sparse(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """uint8 payload ``[indices (index_dtype) | values (new.dtype)]`` of the changed elements."""
    new_bits = bits(new)
    idx = torch.nonzero(new_bits != bits(base)).squeeze(1).to(index_dtype(new.numel()))
    values = new_bits[idx]
    return torch.cat([idx.view(torch.uint8), values.view(torch.uint8)])


def apply_sparse(held: torch.Tensor, payload: torch.Tensor, nnz: int) -> torch.Tensor:
    """Scatter a payload from :func:`encode_sparse` into ``held`` in place; returns the indices."""
    idx_dtype = index_dtype(held.numel())
    split = nnz * idx_dtype.itemsize
    idx = payload[:split].view(idx_dtype)
    held_bits = bits(held)
    held_bits[idx.long()] = payload[split:].view(held_bits.dtype)
    return idx


class ShadowStore:
    """Bucketed copies of the versions receivers may still hold, on the sender.

    ``put`` stores a version, sharing bucket tensors that are bit-identical to
    the newest stored version (so ``same_bits`` hits the ``is`` fast path for
    frozen buckets). At most ``max_versions`` are kept; the oldest go first. One
    store may serve several senders (one per receiver group) on the same rank.
    Memory: ``nbytes()`` = unique bucket bytes across retained versions, i.e.
    about ``model_bytes * (1 + versions that differ)``; ``put`` briefly holds one
    more copy (the fresh pack) until identical buckets are folded into old ones.
    """

    def __init__(self, max_versions: int = 4):
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        self.max_versions = max_versions
        self._versions: OrderedDict[int, PackedModel] = OrderedDict()

    def put(self, version: int, packed: PackedModel) -> PackedModel:
        latest = self.latest()
        if latest is not None and latest.manifest == packed.manifest:
            packed = PackedModel(
                packed.manifest,
                [
                    old if same_bits(new, old) else new
                    for new, old in zip(packed.buckets, latest.buckets, strict=True)
                ],
            )
        self._versions.pop(version, None)
        self._versions[version] = packed
        while len(self._versions) > self.max_versions:
            self._versions.popitem(last=False)
        return packed

    def get(self, version: int) -> PackedModel | None:
        return self._versions.get(version)

    def latest(self) -> PackedModel | None:
        return next(reversed(self._versions.values()), None)

    def versions(self) -> list[int]:
        return list(self._versions)

    def retain(self, versions: set[int] | list[int]) -> None:
        """Drop every version not listed (call with the versions receivers still hold + the newest)."""
        keep = set(versions)
        for v in [v for v in self._versions if v not in keep]:
            del self._versions[v]

    def nbytes(self) -> int:
        seen: dict[int, int] = {}
        for packed in self._versions.values():
            for b in packed.buckets:
                seen[id(b)] = b.numel() * b.dtype.itemsize
        return sum(seen.values())
