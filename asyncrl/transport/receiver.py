"""The receiving end of a weight sync (a vLLM worker): :class:`WeightReceiver`.
The whole sync, both ends, is pictured in asyncrl/transport/broadcast.py; the wire
protocol is asyncrl/transport/wire.py."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.transport.buckets import Manifest, unpack
from asyncrl.transport.delta import BucketPlan, Kind, Mode, apply_sparse
from asyncrl.transport.group import Heartbeat, TransferError, TransferGroup
from asyncrl.transport.shm import host_identity, map_segment
from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION
from asyncrl.transport.wire import (
    ABANDONED,
    INFLIGHT,
    SyncEnd,
    bucket_counts,
    payload_nbytes,
)


@dataclass
class ReceiveStats:
    version: int
    base_version: int
    mode: str
    bytes_received: int
    buckets_skipped: int
    buckets_sparse: int
    buckets_dense: int
    seconds: float


@dataclass
class HeldCopy:
    """What a receiver holds between syncs. A worker that belongs to several
    groups (one per sync set) hands one copy from receiver to receiver
    (:meth:`WeightReceiver.adopt`), so deltas apply whichever group brings them."""

    version: int = NO_VERSION
    manifest: Manifest | None = None
    buckets: list[torch.Tensor] | None = None


class WeightReceiver(SyncEnd):
    """A vLLM worker's end: receives syncs and keeps (optionally) its own copy.

    With ``hold_copy`` (default) the received buckets are kept on the group's
    device (memory: one model copy, in checkpoint layout) so that
    ``changed_buckets`` and ``sparse_delta`` can be applied onto it; without it
    the receiver reports ``NO_VERSION`` and always gets ``full`` syncs. After a
    failed sync the held copy is dropped (it may be half-written), so the next
    sync is ``full``. ``on_bucket(i)`` runs just before payload ``i`` is posted
    (progress reporting; fault injection in tests).
    """

    def __init__(
        self,
        group: TransferGroup,
        hold_copy: bool = True,
        on_bucket: Callable[[int], None] | None = None,
    ):
        if group.rank == 0:
            raise ValueError("rank 0 is the sender; receivers are ranks 1..N-1")
        super().__init__(group)
        self.hold_copy = hold_copy
        self.on_bucket = on_bucket
        self.version = NO_VERSION
        self.manifest: Manifest | None = None
        self._buckets: list[torch.Tensor] | None = None
        self.last_stats: ReceiveStats | None = None
        self.shard: int | None = None  # resharded syncs: this rank's engine TP shard
        self.src = 0  # the rank a resharded sync's payloads come from
        # held buckets a sync replaced with a segment's mapping: unmapped once the sync is
        # claimed (same-host road), so freeing their pages is not on the sender's wait
        self._replaced: list[torch.Tensor] = []

    def held(self) -> HeldCopy:
        return HeldCopy(self.version, self.manifest, self._buckets)

    def adopt(self, held: HeldCopy) -> None:
        """Continue from another receiver's copy (same worker, another group)."""
        if not self.hold_copy:
            return
        self.version, self.manifest, self._buckets = held.version, held.manifest, held.buckets

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views of the held copy (empty when nothing is held)."""
        if self.manifest is None or self._buckets is None:
            return []
        return unpack(self.manifest, self._buckets)

    @torch.no_grad()
    def receive(self, changed_only: bool = False) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Take part in the next sync; return ``(version, [(name, tensor), ...])``.

        The tensors are views into the receiver's buffers, shaped and typed as
        the sender streamed them, ready for
        ``model_runner.reload_weights(weights_iterator=iter(tensors))``; they
        stay valid until the next ``receive``. ``changed_only`` lists just the
        tensors a delta touched (all of a dense bucket, the touched entries of a
        sparse one). Raises :class:`TransferError` naming the peer, the bucket
        and the version.
        """
        g = self.group
        self._seq += 1
        seq = self._seq
        t0 = time.perf_counter()
        with Heartbeat(g) as self._hb:
            header = self._enter(seq)
            targets, plans, touched = self._receive_buckets(seq, header)
            try:
                g.store.set(g.key("done", seq, g.rank), "1")
            except Exception:  # noqa: BLE001 - the data is complete; a lost store is rank 0's failure
                pass
        assert self.manifest is not None
        version = int(header["v"])
        self.version = version if self.hold_copy else NO_VERSION
        if self.hold_copy:
            self._buckets = targets
        self.last_stats = ReceiveStats(
            version=version,
            base_version=int(header["base"]),
            mode=header["mode"],
            bytes_received=sum(payload_nbytes(self.manifest, i, p) for i, p in enumerate(plans)),
            **bucket_counts(plans),
            seconds=time.perf_counter() - t0,
        )
        views = unpack(self.manifest, targets)
        if changed_only:
            names = {name for i in touched for name in touched[i]}
            views = [(n, t) for n, t in views if n in names]
        return version, views

    def _enter(self, seq: int) -> dict:
        """Post this receiver's arrival (the version it holds) and take the header;
        raises when the sender aborted the sync."""
        g = self.group
        try:
            held = self.version if self.hold_copy else NO_VERSION
            layout = self.manifest.fingerprint if self.manifest is not None else ""
            g.store.set(g.key("arrive", seq, g.rank), f"{held}|{layout}|{host_identity()}")
            header = self.read_header(seq)
        except Exception as e:  # noqa: BLE001 - store or collective: reported the same way
            raise self._failure(seq, None, HEADER_BUCKET, e) from e
        if header["abort"] is not None:
            raise TransferError(
                f"sender aborted the sync: {header['abort']}", [0], HEADER_BUCKET, int(header["v"])
            )
        return self._own_shard(header)

    def _own_shard(self, header: dict) -> dict:
        """A resharded sync's header lists every shard's manifest and plan; keep this
        rank's. Receivers are each engine's workers in TP order after the ``senders``
        ranks (1: rank 0 sends every shard; a tensor-parallel learner's ``shards`` ranks:
        rank ``s`` sends shard ``s``), so rank ``g`` holds shard ``(g - senders) % shards``."""
        n = header.get("shards")
        if not n:
            self.shard = None
            return header
        senders = int(header.get("senders", 1))
        s = self.shard = (self.group.rank - senders) % int(n)
        self.src = s if senders > 1 else 0
        manifests = header["manifest"]
        return {
            **header,
            "fp": header["fp"][s],
            "manifest": manifests[s] if manifests is not None else None,
            "plan": header["plan"][s],
            "shm": header["shm"][s] if header.get("shm") else None,
        }

    def _receive_buckets(
        self, seq: int, header: dict
    ) -> tuple[list[torch.Tensor], list[BucketPlan], dict[int, set[str]]]:
        """The payloads of the sync ``header`` announced: (the buffers they landed in,
        the per-bucket plans, the names each bucket touched)."""
        g = self.group
        try:
            targets = self._targets(header)
        except TransferError:
            g.store.set(g.key("fail", seq, g.rank), "protocol")  # alive, just refusing
            raise
        plans = [BucketPlan(Kind(k), nnz, 0) for k, nnz in header["plan"]]
        refs = header.get("shm")
        if refs is not None and not (isinstance(refs, list) and len(refs) == len(plans)):
            g.store.set(g.key("fail", seq, g.rank), "protocol")
            raise TransferError(
                f"header's shared-memory references do not match its {len(plans)} buckets",
                [0], HEADER_BUCKET, header["v"],
            )  # fmt: skip
        progress = {"bucket": HEADER_BUCKET}
        try:
            touched = self._payloads(targets, plans, progress, refs)
            if refs is not None and any(r is not None for r in refs):
                self._claim(seq)
        except Exception as e:  # noqa: BLE001
            self._drop()
            raise self._failure(seq, int(header["v"]), progress["bucket"], e) from e
        finally:
            self._replaced.clear()  # unmapped (or freed) now, after the claim
        return targets, plans, touched

    def _targets(self, header: dict) -> list[torch.Tensor]:
        """Buffers bucket i lands in: the held copy when it is reusable, else fresh ones."""
        if header["manifest"] is not None:
            manifest = Manifest.from_bytes(header["manifest"].encode())
            if self.manifest is None or manifest != self.manifest:
                self.manifest, self._buckets = manifest, None
        if self.manifest is None or self.manifest.fingerprint != header["fp"]:
            raise TransferError(
                "sender assumed a bucket layout this receiver never got",
                [0],
                HEADER_BUCKET,
                header["v"],
            )
        needs_base = header["mode"] != Mode.FULL.value
        if needs_base and (self._buckets is None or int(header["base"]) != self.version):
            raise TransferError(
                f"delta against version {header['base']} but this receiver holds {self.version}",
                [0],
                HEADER_BUCKET,
                header["v"],
            )
        if self.hold_copy and self._buckets is not None:
            return self._buckets
        return [
            torch.empty(s.numel, dtype=s.dtype, device=self.group.device)
            for s in self.manifest.buckets
        ]

    def _payloads(
        self,
        targets: list[torch.Tensor],
        plans: list[BucketPlan],
        progress: dict[str, int],
        refs: list | None = None,
    ) -> dict[int, set[str]]:
        """Receive every non-skipped bucket, applying bucket i while i+1 is in flight;
        a bucket with a shared-memory reference (``refs[i]``: [segment, offset, bytes]) is
        read from its segment instead: a dense one becomes the held bucket itself (the
        sender's segment mapped copy-on-write: no byte copied; a later delta copies only
        the pages it writes), a sparse one is applied from its staged segment."""
        assert self.manifest is not None
        touched: dict[int, set[str]] = {}
        pending: deque[tuple[int, dist.Work, torch.Tensor]] = deque()

        def finish() -> None:
            i, work, buf = pending.popleft()
            progress["bucket"] = i
            self._wait(work)
            apply(i, buf)

        def apply(i: int, buf: torch.Tensor) -> None:
            spec = self.manifest.buckets[i]
            if plans[i].kind is Kind.SPARSE:
                idx = apply_sparse(targets[i], buf, plans[i].nnz)
                starts = torch.tensor(
                    [e.offset for e in spec.entries], dtype=torch.int64, device=idx.device
                )
                hit = torch.unique(torch.searchsorted(starts, idx.long(), right=True) - 1).tolist()
                touched[i] = {spec.entries[k].name for k in hit}
            else:
                touched[i] = {e.name for e in spec.entries}

        for i, plan in enumerate(plans):
            nbytes = payload_nbytes(self.manifest, i, plan)
            if plan.kind is Kind.SKIP or nbytes == 0:
                continue
            progress["bucket"] = i
            ref = refs[i] if refs is not None else None
            if ref is not None:
                self.group.store.set(self.group.key("at", self._seq, self.group.rank), str(i))
            if self.on_bucket is not None:
                self.on_bucket(i)
            if ref is not None:
                apply(i, self._from_segment(targets, i, _checked_ref(ref, nbytes), plan.kind))
                continue  # a sparse payload's mapping goes here, once applied
            if plan.kind is Kind.DENSE:
                buf = targets[i].view(torch.uint8)
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
            work = (
                self._bcast(buf) if self.shard is None else self.group.pg.recv([buf], self.src, i)
            )
            pending.append((i, work, buf))
            if len(pending) >= INFLIGHT:
                finish()
        while pending:
            finish()
        return touched

    def _from_segment(
        self, targets: list[torch.Tensor], i: int, ref: list, kind: Kind
    ) -> torch.Tensor:
        """Bucket ``i``'s payload from shared memory: a dense one becomes the held bucket
        itself (the sender's segment mapped copy-on-write; the bucket it replaces is kept
        until the claim); a sparse one is its staged segment mapped read-only, applied
        straight from the mapping (no copy)."""
        if kind is Kind.DENSE:
            assert self.manifest is not None
            self._replaced.append(targets[i])
            targets[i] = map_segment(*ref, private=True).view(self.manifest.buckets[i].dtype)
            return targets[i].view(torch.uint8)
        return map_segment(*ref)

    def _claim(self, seq: int) -> None:
        """Claim sync ``seq`` as read (same-host road), unless the sender gave up first."""
        g = self.group
        if g.store.compare_set(g.key("read", seq, g.rank), "", "read").decode() == ABANDONED:
            raise RuntimeError("the sender gave up on this sync before this receiver read it")

    def _drop(self) -> None:
        self.version, self._buckets = NO_VERSION, None


def _checked_ref(ref: object, nbytes: int) -> list:
    """A header's ``[segment, offset, bytes]`` for a payload the manifest says is ``nbytes``
    (the segment itself is checked when mapped)."""
    if not (isinstance(ref, list) and len(ref) == 3) or ref[2] != nbytes:
        raise TransferError(f"header's segment reference {str(ref)[:120]} is not {nbytes} B")
    if ref[1] % 8:  # bucket dtypes are at most 8 bytes wide
        raise TransferError(f"header's segment reference {str(ref)[:120]} is misaligned")
    return ref
