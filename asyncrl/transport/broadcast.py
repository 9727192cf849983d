"""Bucketed weight broadcast from learner rank 0 to N vLLM workers.

One sync, as both sides see it (rank 0 = :class:`WeightSender`, ranks 1..N-1 =
:class:`WeightReceiver`, one :class:`~asyncrl.transport.group.TransferGroup`)::

    sender                                   each receiver
    pack stream -> shadow[v]                 receive(): post arrive/<seq> = held version
    wait all arrive/<seq> (store, timeout) <-'
    plan per bucket vs shadow[held]
    bcast header (len, json) --------------> learn version, mode, plan (+ manifest once)
    for each non-skipped bucket i:           for each non-skipped bucket i:
      encode i+1 while i is in flight          post recv i+1 while applying i
      bcast payload i ---------------------->  dense: straight into held copy
                                               sparse: scatter (idx, values) into it
                                             post done/<seq>; return (v, named views)

Receivers of one group must hold the same version for a sync: the broker
groups receivers by version (one group per sync set) and :meth:`WeightSender.send`
checks the arrivals, aborting the sync cleanly (header with a reason, group
still usable) when they disagree. A failed collective or a deadline raises
:class:`TransferError` on every live rank and leaves the group unusable.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.transport.buckets import DEFAULT_BUCKET_MB, Manifest, PackedModel, pack, unpack
from asyncrl.transport.delta import (
    BucketPlan,
    Kind,
    Mode,
    ShadowStore,
    apply_sparse,
    encode_sparse,
    plan_bucket,
    sparse_nbytes,
)
from asyncrl.transport.group import (
    HEADER_BUCKET,
    Heartbeat,
    TransferError,
    TransferGroup,
    diagnose,
    wait_work,
)

NO_VERSION = -1  # what a receiver holding no weights reports
# Two payloads in flight: the wire stays busy while the next one is encoded,
# and memory stays at two buckets rather than the whole sync.
INFLIGHT = 2
_MAGIC = 0x4152_4C57  # "ARLW": catches a receiver reading a bucket as a header


@dataclass
class SendStats:
    """One sync, as the sender saw it. ``gbps`` is gigabytes (1e9 B) per second."""

    version: int
    base_version: int
    mode: str  # the mode actually used: a delta with no usable base becomes "full"
    bytes_sent: int  # header + payloads
    header_bytes: int
    bytes_full: int  # what "full" would have sent
    buckets_total: int
    buckets_skipped: int
    buckets_sparse: int
    buckets_dense: int
    pack_seconds: float
    wait_seconds: float  # waiting for receivers to arrive
    seconds: float  # header + payloads
    gbps: float

    def metrics(self) -> dict[str, float]:
        return {
            "broker/bytes_sent": self.bytes_sent,
            "broker/bytes_full": self.bytes_full,
            "broker/buckets_skipped": self.buckets_skipped,
            "broker/buckets_sparse": self.buckets_sparse,
            "broker/seconds": self.seconds,
            "broker/gbps": self.gbps,
        }


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


def _bcast_opts(timeout_s: float) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


class _Sync:
    """Shared plumbing: sequence numbers, the header, failure diagnosis."""

    def __init__(self, group: TransferGroup):
        self.group = group
        self._seq = 0
        self._opts = _bcast_opts(group.timeout_s)
        self._hb: Heartbeat | None = None  # set while a sync runs

    def _bcast(self, buf: torch.Tensor) -> dist.Work:
        return self.group.pg.broadcast([buf], self._opts)

    def _wait(self, work: dist.Work) -> None:
        hb = self._hb
        if hb is not None:
            hb.enter("wait")
        try:
            wait_work(self.group, work, time.monotonic() + self.group.timeout_s)
        finally:
            if hb is not None:
                hb.enter("work")

    def _header(self, header: dict | None) -> tuple[dict, int]:
        """Broadcast ``[magic, nbytes]`` then ``nbytes`` of JSON; returns the header
        (on every rank) and its size on the wire."""
        g = self.group
        data = json.dumps(header, separators=(",", ":")).encode() if header is not None else b""
        meta = torch.tensor([_MAGIC, len(data)], dtype=torch.int64, device=g.device)
        self._wait(self._bcast(meta))
        magic, nbytes = meta.tolist()
        if magic != _MAGIC:
            raise RuntimeError(f"header magic {magic:#x} != {_MAGIC:#x}: ranks are out of step")
        if header is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(g.device)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=g.device)
        self._wait(self._bcast(buf))
        if header is None:
            header = json.loads(bytes(buf.cpu().numpy()).decode())
        return header, meta.numel() * meta.element_size() + nbytes

    def _failure(
        self, seq: int, version: int | None, bucket: int, exc: BaseException
    ) -> TransferError:
        """Report our failure, then name the peers that went silent (dead or stuck)."""
        g = self.group
        try:
            g.store.set(g.key("fail", seq, g.rank), repr(exc)[:500])
            others = [r for r in range(g.world_size) if r != g.rank]
            silent, stuck = diagnose(g, seq, others)
        except Exception:  # noqa: BLE001 - the store lives on rank 0: if it is gone, so is rank 0
            silent, stuck = ([0] if g.rank != 0 else []), []
        if silent:
            reason = f"peer went silent (dead or frozen): {exc}"
            peers = silent
        elif stuck:
            reason = f"peer is alive but stuck outside the transfer: {exc}"
            peers = stuck
        else:
            reason = f"collective failed with every peer alive: {exc}"
            peers = (
                [0]
                if g.rank != 0
                else [r for r in range(1, g.world_size) if not g.has(g.key("done", seq, r))]
            )
        return TransferError(reason, peers, bucket, version)


class WeightSender(_Sync):
    """Learner rank 0: broadcasts versions of the model to the receivers of one group.

    ``shadows`` may be shared by several senders (one per receiver group) on the
    same rank; by default each sender keeps its own. Shadows live on
    ``shadow_device`` (default: the group's device; ``"cpu"`` trades a host copy
    per bucket for GPU memory).
    """

    def __init__(
        self,
        group: TransferGroup,
        shadows: ShadowStore | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shadow_device: torch.device | str | None = None,
    ):
        if group.rank != 0:
            raise ValueError(f"WeightSender must be rank 0 of its group, got rank {group.rank}")
        super().__init__(group)
        self.shadows = shadows if shadows is not None else ShadowStore()
        self.bucket_mb = bucket_mb
        self.shadow_device = (
            torch.device(shadow_device) if shadow_device is not None else group.device
        )
        self._peer_manifest: str | None = None  # fingerprint the receivers already have

    @torch.no_grad()
    def send(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
        receiver_version: int | None = None,
        mode: Mode | str = Mode.SPARSE,
    ) -> SendStats:
        """Bring every receiver of the group from ``receiver_version`` to ``version``.

        ``named_tensors``: the full model as an ordered stream (full tensors, not
        DTensor shards), consumed once into ``shadows[version]``; ``None`` reuses
        the stored ``version`` (for a second receiver group). ``receiver_version``:
        what the receivers hold (``NO_VERSION`` for nothing; ``None``: take it
        from their arrivals). Deltas go against exactly that version, however far
        behind; without its shadow the sync is ``full``. Blocks until the last
        payload is handed to the wire; raises :class:`TransferError` naming the
        silent peer, the bucket and ``version``.
        """
        mode = Mode(mode)
        g = self.group
        t0 = time.perf_counter()
        if named_tensors is not None:
            packed = self.shadows.put(
                version, pack(named_tensors, self.bucket_mb, self.shadow_device)
            )
        elif (packed := self.shadows.get(version)) is None:
            raise KeyError(
                f"version {version} is not in the shadow store (have {self.shadows.versions()})"
            )
        t1 = time.perf_counter()
        self._seq += 1
        seq = self._seq
        with Heartbeat(g) as self._hb:
            held = self._arrivals(seq, version)
            t2 = time.perf_counter()
            abort = self._version_mismatch(held, receiver_version)
            # No receivers (a group of one, for smoke tests): the caller says what they hold.
            base_version = next(iter(held.values()), _or_none(receiver_version))
            used, plans = (
                self._plan(packed, base_version, mode) if abort is None else (Mode.FULL, [])
            )
            header = self._make_header(version, base_version, used, packed.manifest, plans, abort)
            try:
                header_bytes = self._header(header)[1]
            except Exception as e:  # noqa: BLE001 - any collective failure is reported the same way
                raise self._failure(seq, version, HEADER_BUCKET, e) from e
            if abort is not None:  # receivers saw the reason too; the group stays usable
                raise TransferError(abort[0], abort[1], HEADER_BUCKET, version)
            self._peer_manifest = packed.manifest.fingerprint
            progress = {"bucket": HEADER_BUCKET}
            try:
                self._payloads(packed, self.shadows.get(base_version), plans, progress)
            except Exception as e:  # noqa: BLE001
                raise self._failure(seq, version, progress["bucket"], e) from e
            g.store.set(g.key("done", seq, 0), "1")
        t3 = time.perf_counter()
        sent = header_bytes + sum(p.nbytes for p in plans)
        return SendStats(
            version=version,
            base_version=base_version,
            mode=used.value,
            bytes_sent=sent,
            header_bytes=header_bytes,
            bytes_full=packed.manifest.nbytes,
            buckets_total=len(plans),
            buckets_skipped=sum(p.kind is Kind.SKIP for p in plans),
            buckets_sparse=sum(p.kind is Kind.SPARSE for p in plans),
            buckets_dense=sum(p.kind is Kind.DENSE for p in plans),
            pack_seconds=t1 - t0,
            wait_seconds=t2 - t1,
            seconds=t3 - t2,
            gbps=sent / max(t3 - t2, 1e-9) / 1e9,
        )

    def _plan(
        self, packed: PackedModel, base_version: int, mode: Mode
    ) -> tuple[Mode, list[BucketPlan]]:
        """Per-bucket plan against the receivers' version; ``full`` when there is no usable base."""
        base = self.shadows.get(base_version) if base_version != NO_VERSION else None
        if base is None or base.manifest != packed.manifest:  # evicted, or the layout changed
            return Mode.FULL, [plan_bucket(Mode.FULL, new, None) for new in packed.buckets]
        return mode, [
            plan_bucket(mode, new, old)
            for new, old in zip(packed.buckets, base.buckets, strict=True)
        ]

    def _arrivals(self, seq: int, version: int) -> dict[int, int]:
        """Wait (store only, no collective) until every receiver entered sync ``seq``."""
        g = self.group
        keys = {r: g.key("arrive", seq, r) for r in range(1, g.world_size)}
        if self._hb is not None:
            self._hb.enter("wait")
        try:
            g.store.wait(list(keys.values()), datetime.timedelta(seconds=g.timeout_s))
        except Exception as e:  # noqa: BLE001 - DistStoreError on timeout, others if the store broke
            # Receivers that did arrive will time out on the header; this tells them we are alive.
            g.store.set(g.key("fail", seq, 0), "arrivals")
            missing = [r for r, k in keys.items() if not g.has(k)] or list(keys)
            raise TransferError(
                f"receiver(s) did not enter the sync within {g.timeout_s:.1f}s "
                f"(not calling receive(), or dead): {e}",
                missing,
                HEADER_BUCKET,
                version,
            ) from e
        if self._hb is not None:
            self._hb.enter("work")
        held = {r: int(g.store.get(k)) for r, k in keys.items()}
        for r in range(g.world_size):  # everyone is past seq-1 now: its keys can go
            for kind in ("arrive", "done", "fail"):
                g.store.delete_key(g.key(kind, seq - 1, r))
        return held

    @staticmethod
    def _version_mismatch(
        held: dict[int, int], expected: int | None
    ) -> tuple[str, list[int]] | None:
        if not held:
            return None
        first = next(iter(held.values()))
        want = first if expected is None else expected
        wrong = sorted(r for r, v in held.items() if v != want)
        if not wrong:
            return None
        return f"receivers hold versions {held}, but one sync needs them all at {want}", wrong

    def _make_header(
        self,
        version: int,
        base_version: int,
        used: Mode,
        manifest: Manifest,
        plans: list[BucketPlan],
        abort: tuple[str, list[int]] | None,
    ) -> dict:
        fp = manifest.fingerprint
        return {
            "v": version,
            "base": base_version,
            "mode": used.value,
            "fp": fp,
            # Sent once per group (and again only if the layout changes).
            "manifest": manifest.to_bytes().decode() if fp != self._peer_manifest else None,
            "plan": [[int(p.kind), p.nnz] for p in plans],
            "abort": abort[0] if abort is not None else None,
        }

    def _payloads(
        self,
        packed: PackedModel,
        base: PackedModel | None,
        plans: list[BucketPlan],
        progress: dict[str, int],
    ) -> None:
        """Broadcast every non-skipped bucket, encoding bucket i+1 while i is in flight."""
        pending: deque[tuple[int, dist.Work, torch.Tensor]] = deque()
        for i, plan in enumerate(plans):
            if plan.kind is Kind.SKIP or plan.nbytes == 0:
                continue
            new = packed.buckets[i]
            if plan.kind is Kind.SPARSE:
                assert base is not None
                payload = encode_sparse(new, base.buckets[i])
            else:
                payload = new.view(torch.uint8)
            payload = payload.to(self.group.device)
            assert payload.numel() == plan.nbytes, (i, payload.numel(), plan)
            progress["bucket"] = i
            pending.append((i, self._bcast(payload), payload))
            if len(pending) >= INFLIGHT:
                self._retire(pending, progress)
        while pending:
            self._retire(pending, progress)

    def _retire(
        self, pending: deque[tuple[int, dist.Work, torch.Tensor]], progress: dict[str, int]
    ) -> None:
        i, work, _ = pending.popleft()  # the payload rides along so it outlives its collective
        progress["bucket"] = i
        self._wait(work)


@dataclass
class HeldCopy:
    """What a receiver holds between syncs. A worker that belongs to several
    groups (one per sync set) hands one copy from receiver to receiver
    (:meth:`WeightReceiver.adopt`), so deltas apply whichever group brings them."""

    version: int = NO_VERSION
    manifest: Manifest | None = None
    buckets: list[torch.Tensor] | None = None


class WeightReceiver(_Sync):
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
            try:
                g.store.set(
                    g.key("arrive", seq, g.rank),
                    str(self.version if self.hold_copy else NO_VERSION),
                )
                header = self._header(None)[0]
            except Exception as e:  # noqa: BLE001 - store or collective: reported the same way
                raise self._failure(seq, None, HEADER_BUCKET, e) from e
            version = int(header["v"])
            if header["abort"] is not None:
                raise TransferError(
                    f"sender aborted the sync: {header['abort']}", [0], HEADER_BUCKET, version
                )
            try:
                targets = self._targets(header)
            except TransferError:
                g.store.set(g.key("fail", seq, g.rank), "protocol")  # alive, just refusing
                raise
            plans = [BucketPlan(Kind(k), nnz, 0) for k, nnz in header["plan"]]
            progress = {"bucket": HEADER_BUCKET}
            try:
                touched = self._payloads(targets, plans, progress)
            except Exception as e:  # noqa: BLE001
                self._drop()
                raise self._failure(seq, version, progress["bucket"], e) from e
            try:
                g.store.set(g.key("done", seq, g.rank), "1")
            except Exception:  # noqa: BLE001 - the data is complete; a lost store is rank 0's failure
                pass
        assert self.manifest is not None
        self.version = version if self.hold_copy else NO_VERSION
        if self.hold_copy:
            self._buckets = targets
        self.last_stats = ReceiveStats(
            version=version,
            base_version=int(header["base"]),
            mode=header["mode"],
            bytes_received=sum(_nbytes(self.manifest, i, p) for i, p in enumerate(plans)),
            buckets_skipped=sum(p.kind is Kind.SKIP for p in plans),
            buckets_sparse=sum(p.kind is Kind.SPARSE for p in plans),
            buckets_dense=sum(p.kind is Kind.DENSE for p in plans),
            seconds=time.perf_counter() - t0,
        )
        views = unpack(self.manifest, targets)
        if changed_only:
            names = {name for i in touched for name in touched[i]}
            views = [(n, t) for n, t in views if n in names]
        return version, views

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
        self, targets: list[torch.Tensor], plans: list[BucketPlan], progress: dict[str, int]
    ) -> dict[int, set[str]]:
        """Receive every non-skipped bucket, applying bucket i while i+1 is in flight."""
        assert self.manifest is not None
        touched: dict[int, set[str]] = {}
        pending: deque[tuple[int, dist.Work, torch.Tensor]] = deque()

        def finish() -> None:
            i, work, buf = pending.popleft()
            progress["bucket"] = i
            self._wait(work)
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
            nbytes = _nbytes(self.manifest, i, plan)
            if plan.kind is Kind.SKIP or nbytes == 0:
                continue
            if plan.kind is Kind.DENSE:
                buf = targets[i].view(torch.uint8)
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
            progress["bucket"] = i
            if self.on_bucket is not None:
                self.on_bucket(i)
            pending.append((i, self._bcast(buf), buf))
            if len(pending) >= INFLIGHT:
                finish()
        while pending:
            finish()
        return touched

    def _drop(self) -> None:
        self.version, self._buckets = NO_VERSION, None


def _or_none(version: int | None) -> int:
    return NO_VERSION if version is None else version


def _nbytes(manifest: Manifest, i: int, plan: BucketPlan) -> int:
    spec = manifest.buckets[i]
    if plan.kind is Kind.SKIP:
        return 0
    if plan.kind is Kind.DENSE:
        return spec.nbytes
    return sparse_nbytes(plan.nnz, spec.numel, spec.dtype.itemsize)
