"""Bucketed weight broadcast from learner rank 0 to N vLLM workers.

One sync, as both sides see it (rank 0 = :class:`WeightSender`, here; ranks 1..N-1 =
:class:`~asyncrl.transport.receiver.WeightReceiver`; one
:class:`~asyncrl.transport.group.TransferGroup`; the wire protocol: wire.py)::

    sender                                   each receiver
    pack stream -> shadow[v]                 receive(): post arrive/<seq> = held|layout|host
    wait all arrive/<seq> (store, timeout) <-'
    plan per bucket vs shadow[held]
    set header/<seq> (one store value) ----> get header/<seq>: version, mode, plan,
                                               manifest (once per layout)
    for each non-skipped bucket i:           for each non-skipped bucket i:
      encode i+1 while i is in flight          post recv i+1 while applying i
      bcast payload i ---------------------->  dense: straight into held copy
                                               sparse: scatter (idx, values) into it
                                             post done/<seq>; return (v, named views)

When every receiver posted this host's identity with its arrival and the sender has a
:class:`~asyncrl.transport.shm.ShmArena` (gloo groups only), the payloads take the
same-host road instead (asyncrl/transport/shm.py): the header names, per bucket, the
shared-memory segment holding its payload, no payload crosses the wire, and the sender
waits for every receiver's claim (``read/<seq>``) before it returns (and unlinks this
sync's staged segments): :class:`~asyncrl.transport.shm_send.ShmRoad`. Buckets without a
segment still go over the wire, in order.

Receivers of one group must hold the same version for a sync: the broker
groups receivers by version (one group per sync set) and :meth:`WeightSender.send`
checks the arrivals, aborting the sync cleanly (header with a reason, group
still usable) when they disagree. A failed collective or a deadline raises
:class:`TransferError` on every live rank and leaves the group unusable.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.transport.buckets import DEFAULT_BUCKET_MB, Manifest, PackedModel, pack
from asyncrl.transport.delta import (
    BucketPlan,
    Kind,
    Mode,
    ShadowStore,
    encode_sparse,
    plan_bucket,
)
from asyncrl.transport.group import Heartbeat, TransferError, TransferGroup
from asyncrl.transport.shm import ShmArena
from asyncrl.transport.shm_send import ShmRefs, ShmRoad, any_shm
from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION
from asyncrl.transport.wire import (
    INFLIGHT,
    SYNC_KEYS,
    SyncEnd,
    bucket_counts,
    header_key,
)


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
    # what one engine worker received: everything broadcast, or its own shard (resharded)
    bytes_per_rank: int = 0
    shard_digests: list[dict[str, str]] | None = None  # resharded, when asked: per shard
    road: str = "wire"  # "shm": payloads read from shared memory (transport/shm.py)
    # a tensor-parallel learner's ranks sending their own shards (transport/tp_send.py):
    # what each sent (rank 0's with the header); None when rank 0 sends everything
    bytes_per_learner_rank: list[int] | None = None

    def metrics(self) -> dict[str, float]:
        return {
            "broker/bytes_sent": self.bytes_sent,
            "broker/bytes_per_engine_rank": self.bytes_per_rank,
            "broker/bytes_per_learner_rank": max(self.bytes_per_learner_rank or [self.bytes_sent]),
            "broker/bytes_full": self.bytes_full,
            "broker/buckets_skipped": self.buckets_skipped,
            "broker/buckets_sparse": self.buckets_sparse,
            "broker/seconds": self.seconds,
            "broker/gbps": self.gbps,
        }


class WeightSender(SyncEnd):
    """Learner rank 0: broadcasts versions of the model to the receivers of one group.
    (``sender_ranks`` > 1: ranks ``0..sender_ranks-1`` are a tensor-parallel learner's
    ranks, each sending its own shard; asyncrl/transport/tp_send.py.)

    ``shadows`` may be shared by several senders (one per receiver group) on the
    same rank; by default each sender keeps its own. Shadows live on
    ``shadow_device`` (default: the group's device; ``"cpu"`` trades a host copy
    per bucket for GPU memory). ``shm``: the arena whose segments hold the shadows'
    buckets; with it, a sync whose receivers are all on this host takes the
    same-host road (module docstring).
    """

    def __init__(
        self,
        group: TransferGroup,
        shadows: ShadowStore | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shadow_device: torch.device | str | None = None,
        shm: ShmArena | None = None,
        sender_ranks: int = 1,
    ):
        if group.rank >= sender_ranks:
            raise ValueError(
                f"a WeightSender is one of ranks 0..{sender_ranks - 1} of its group, "
                f"got rank {group.rank}"
            )
        super().__init__(group)
        self.sender_ranks = sender_ranks  # ranks 0.. send (transport/tp_send.py), the rest receive
        self.shadows = shadows if shadows is not None else ShadowStore()
        self.bucket_mb = bucket_mb
        self.shadow_device = (
            torch.device(shadow_device) if shadow_device is not None else group.device
        )
        self._peer_manifest: str | None = None  # fingerprint the receivers already have
        self.held_layouts: dict[int, str] = {}  # rank -> fingerprint of its held copy
        self.held_hosts: dict[int, str] = {}  # rank -> the host identity it posted
        self.road = ShmRoad(group, shm)  # the same-host road (asyncrl/transport/shm_send.py)

    @torch.no_grad()
    def send(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
        receiver_version: int | None = None,
        mode: Mode | str = Mode.SPARSE,
        arrive_timeout_s: float | None = None,
    ) -> SendStats:
        """Bring every receiver of the group from ``receiver_version`` to ``version``.

        ``named_tensors``: the full model as an ordered stream (full tensors, not
        DTensor shards), consumed once into ``shadows[version]``; ``None`` reuses
        the stored ``version`` (for a second receiver group). ``receiver_version``:
        what the receivers hold (``NO_VERSION`` for nothing; ``None``: take it
        from their arrivals). Deltas go against exactly that version, however far
        behind; without its shadow the sync is ``full``. ``arrive_timeout_s``: how long
        the receivers may take to enter the sync (default: the group's timeout). Blocks until the last
        payload is handed to the wire; raises :class:`TransferError` naming the
        silent peer, the bucket and ``version``.
        """
        mode = Mode(mode)
        t0 = time.perf_counter()
        packed = self._packed(version, named_tensors)
        t1 = time.perf_counter()
        self._seq += 1
        seq = self._seq
        try:
            with Heartbeat(self.group) as self._hb:
                held = self._arrivals(seq, version, arrive_timeout_s or self.group.timeout_s)
                t2 = time.perf_counter()
                base_version, used, plans, header_bytes, road = self._sync(
                    seq, version, packed, held, receiver_version, mode
                )
            t3 = time.perf_counter()
        finally:
            self._forget(seq - 1)
        sent = header_bytes + sum(p.nbytes for p in plans)
        return SendStats(
            version=version,
            base_version=base_version,
            mode=used.value,
            bytes_sent=sent,
            header_bytes=header_bytes,
            bytes_full=packed.manifest.nbytes,
            buckets_total=len(plans),
            **bucket_counts(plans),
            pack_seconds=t1 - t0,
            wait_seconds=t2 - t1,
            seconds=t3 - t2,
            gbps=sent / max(t3 - t2, 1e-9) / 1e9,
            bytes_per_rank=sent,
            road=road,
        )

    def _packed(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | None
    ) -> PackedModel:
        """``version`` packed into buckets: from the stream (stored as its shadow),
        or the shadow stored before."""
        if named_tensors is not None:
            alloc = self.road.arena.alloc if self.road.arena is not None else None
            return self.shadows.put(
                version, pack(named_tensors, self.bucket_mb, self.shadow_device, alloc=alloc)
            )
        packed = self.shadows.get(version)
        if packed is None:
            raise KeyError(
                f"version {version} is not in the shadow store (have {self.shadows.versions()})"
            )
        return packed

    def _sync(
        self,
        seq: int,
        version: int,
        packed: PackedModel,
        held: dict[int, int],
        receiver_version: int | None,
        mode: Mode,
    ) -> tuple[int, Mode, list[BucketPlan], int, str]:
        """The header, then the payloads, to receivers holding ``held`` (rank ->
        version). Returns (base version, mode used, per-bucket plans, header bytes, road)."""
        g = self.group
        abort = self._version_mismatch(held, receiver_version)
        # No receivers (a group of one, for smoke tests): the caller says what they hold.
        base_version = next(iter(held.values()), _or_none(receiver_version))
        used, plans = self._plan(packed, base_version, mode) if abort is None else (Mode.FULL, [])
        base = self.shadows.get(base_version)
        try:
            refs = None
            if abort is None and self.road.usable(self.held_hosts):
                refs = self.road.refs(packed, plans, functools.partial(self._encode, packed, base))
            header = self._make_header(
                version, base_version, used, packed.manifest, plans, abort, refs
            )
            header_bytes = self._announce(seq, version, header, abort, packed.manifest.fingerprint)
            progress = {"bucket": HEADER_BUCKET}
            try:
                self._payloads(packed, base, plans, progress, refs)
                if any_shm(refs):
                    self.road.await_reads(seq, progress, self._hb)
            except Exception as e:  # noqa: BLE001
                raise self._failure(seq, version, progress["bucket"], e) from e
        finally:
            self.road.unstage()
        g.store.set(g.key("done", seq, 0), "1")
        return base_version, used, plans, header_bytes, "shm" if any_shm(refs) else "wire"

    def _plan(
        self, packed: PackedModel, base_version: int, mode: Mode
    ) -> tuple[Mode, list[BucketPlan]]:
        """Per-bucket plan against the receivers' version; ``full`` when there is no usable base."""
        base = self.shadows.get(base_version) if base_version != NO_VERSION else None
        if any(fp != packed.manifest.fingerprint for fp in self.held_layouts.values()):
            base = None  # a receiver holds another layout (resharded before): full
        return plan_against(packed, base, mode)

    # ---- resharded: each receiver gets only its engine TP rank's shard ----------------
    @torch.no_grad()
    def send_shards(
        self,
        version: int,
        packs: list[PackedModel],
        bases: list[PackedModel | None],
        receiver_version: int,
        mode: Mode | str = Mode.SPARSE,
        arrive_timeout_s: float | None = None,
    ) -> SendStats:
        """Like :meth:`send`, but receiver ``g`` (ranks ``1..N-1``, each engine's workers
        in TP order) gets only ``packs[(g - 1) % len(packs)]``, point to point; deltas go
        per shard against ``bases`` (the shards of ``receiver_version``, None where its
        shadow is gone). One header (broadcast) carries every shard's manifest and plan."""
        mode = Mode(mode)
        n = len(packs)
        dsts = [[g for g in range(1, self.group.world_size) if (g - 1) % n == s] for s in range(n)]
        self._seq += 1
        seq = self._seq
        t1 = time.perf_counter()
        try:
            with Heartbeat(self.group) as self._hb:
                held = self._arrivals(seq, version, arrive_timeout_s or self.group.timeout_s)
                t2 = time.perf_counter()
                abort = self._version_mismatch(held, receiver_version)
                used, plans = self._plan_shards(packs, bases, dsts, mode)
                try:
                    header_bytes, refs = self._shards_sync(
                        seq, version, receiver_version, used, packs, bases, plans, dsts, abort
                    )
                finally:
                    self.road.unstage()
                self.group.store.set(self.group.key("done", seq, 0), "1")
            t3 = time.perf_counter()
        finally:
            self._forget(seq - 1)
        per_shard = [sum(b.nbytes for b in pl) for pl in plans]
        sent = header_bytes + sum(b * len(d) for b, d in zip(per_shard, dsts, strict=True))
        return SendStats(
            version=version,
            base_version=receiver_version,
            mode=used.value,
            bytes_sent=sent,
            header_bytes=header_bytes,
            bytes_full=sum(p.manifest.nbytes * len(d) for p, d in zip(packs, dsts, strict=True)),
            buckets_total=sum(len(pl) for pl in plans),
            **bucket_counts([b for pl in plans for b in pl]),
            pack_seconds=0.0,
            wait_seconds=t2 - t1,
            seconds=t3 - t2,
            gbps=sent / max(t3 - t2, 1e-9) / 1e9,
            bytes_per_rank=header_bytes + max(per_shard, default=0),
            road="shm" if any(any_shm(r) for r in refs or ()) else "wire",
        )

    def _shards_sync(
        self, seq: int, version: int, base: int, used: Mode, packs: list[PackedModel],
        bases: list[PackedModel | None], plans: list[list[BucketPlan]], dsts: list[list[int]],
        abort: tuple[str, list[int]] | None,
    ) -> tuple[int, list[ShmRefs | None] | None]:  # fmt: skip
        """The header, then each shard's payloads (wire or shared memory); returns (header
        bytes, the shards' shared-memory references or None)."""
        refs = None
        if abort is None and self.road.usable(self.held_hosts):
            refs = [
                self.road.refs(p, pl, functools.partial(self._encode, p, b))
                for p, b, pl in zip(packs, bases, plans, strict=True)
            ]
        header = self._shard_header(version, base, used, packs, plans, abort, refs)
        header_bytes = self._announce(seq, version, header, abort, "|".join(header["fp"]))
        progress = {"bucket": HEADER_BUCKET}
        try:
            for s in range(len(packs)):
                shard_refs = refs[s] if refs is not None else None
                self._sends(packs[s], bases[s], plans[s], dsts[s], progress, shard_refs)
            if any(any_shm(r) for r in refs or ()):
                self.road.await_reads(seq, progress, self._hb)
        except Exception as e:  # noqa: BLE001
            raise self._failure(seq, version, progress["bucket"], e) from e
        return header_bytes, refs

    def _plan_shards(
        self,
        packs: list[PackedModel],
        bases: list[PackedModel | None],
        dsts: list[list[int]],
        mode: Mode,
    ) -> tuple[Mode, list[list[BucketPlan]]]:
        """Per shard, per bucket; ``full`` for all when any shard has no usable base (a
        receiver holding another layout, full tensors before, has none)."""
        planned = [
            plan_against(p, b if all(self.held_layouts.get(g) == p.manifest.fingerprint
                                     for g in d) else None, mode)
            for p, b, d in zip(packs, bases, dsts, strict=True)
        ]  # fmt: skip
        if any(u is Mode.FULL for u, _ in planned):
            return Mode.FULL, [plan_against(p, None, Mode.FULL)[1] for p in packs]
        return mode, [pl for _, pl in planned]

    def _shard_header(
        self,
        version: int,
        base: int,
        used: Mode,
        packs: list[PackedModel],
        plans: list[list[BucketPlan]],
        abort: tuple[str, list[int]] | None,
        shm: list[ShmRefs | None] | None = None,
    ) -> dict:
        """Every shard's fingerprint, manifest (once per group and layout), plan and
        shared-memory references."""
        fps = [p.manifest.fingerprint for p in packs]
        known = self._peer_manifest == "|".join(fps)
        return {
            "v": version,
            "base": base,
            "mode": used.value,
            "shards": len(packs),
            "fp": fps,
            "manifest": None if known else [p.manifest.to_bytes().decode() for p in packs],
            "plan": [[[int(b.kind), b.nnz] for b in pl] for pl in plans],
            "abort": abort[0] if abort is not None else None,
            "shm": shm,
        }

    def _sends(
        self,
        packed: PackedModel,
        base: PackedModel | None,
        plans: list[BucketPlan],
        dsts: list[int],
        progress: dict[str, int],
        refs: ShmRefs | None = None,
    ) -> None:
        """Send one shard's non-skipped buckets not in shared memory to each of ``dsts``
        (tag: bucket index)."""
        pending: deque[tuple[int, dist.Work, torch.Tensor]] = deque()
        for i, plan in enumerate(plans):
            if plan.kind is Kind.SKIP or plan.nbytes == 0 or (refs and refs[i] is not None):
                continue
            payload = self._encode(packed, base, i, plan)
            progress["bucket"] = i
            for dst in dsts:
                pending.append((i, self.group.pg.send([payload], dst, i), payload))
            while len(pending) > INFLIGHT * max(1, len(dsts)):
                self._retire(pending, progress)
        while pending:
            self._retire(pending, progress)

    def _encode(
        self, packed: PackedModel, base: PackedModel | None, i: int, plan: BucketPlan
    ) -> torch.Tensor:
        """Bucket ``i``'s payload on the group's device: its bytes, or the sparse delta."""
        new = packed.buckets[i]
        if plan.kind is Kind.SPARSE:
            assert base is not None
            payload = encode_sparse(new, base.buckets[i])
        else:
            payload = new.view(torch.uint8)
        payload = payload.to(self.group.device)
        assert payload.numel() == plan.nbytes, (i, payload.numel(), plan)
        return payload

    def _announce(
        self,
        seq: int,
        version: int,
        header: dict,
        abort: tuple[str, list[int]] | None,
        fingerprint: str,
    ) -> int:
        """Post sync ``seq``'s header; raise the abort it carries (receivers saw the reason
        too; the group stays usable), else remember the layout the receivers will hold.
        Returns the header's bytes."""
        try:
            header_bytes = self.post_header(seq, header)
        except Exception as e:  # noqa: BLE001 - a store failure is reported like any other
            raise self._failure(seq, version, HEADER_BUCKET, e) from e
        if abort is not None:
            raise TransferError(abort[0], abort[1], HEADER_BUCKET, version)
        self._peer_manifest = fingerprint
        return header_bytes

    def _arrivals(self, seq: int, version: int, timeout_s: float) -> dict[int, int]:
        """Wait (store only, no collective) until every receiver entered sync ``seq``."""
        g = self.group
        keys = {r: g.key("arrive", seq, r) for r in range(self.sender_ranks, g.world_size)}
        if self._hb is not None:
            self._hb.enter("wait")
        try:
            g.store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - DistStoreError on timeout, others if the store broke
            # Receivers that did arrive will time out on the header; this tells them we are alive.
            g.store.set(g.key("fail", seq, 0), "arrivals")
            missing = [r for r, k in keys.items() if not g.has(k)] or list(keys)
            raise TransferError(
                f"receiver(s) did not enter the sync within {timeout_s:.1f}s "
                f"(not calling receive(), or dead): {e}",
                missing,
                HEADER_BUCKET,
                version,
            ) from e
        if self._hb is not None:
            self._hb.enter("work")
        values = g.store.multi_get(list(keys.values())) if keys else []  # one round trip
        arrived = dict(zip(keys, (v.decode().split("|") for v in values), strict=True))
        held = {r: int(a[0]) for r, a in arrived.items()}
        # the bucket layout each holds: a delta applies only onto the same layout
        self.held_layouts = {r: a[1] if len(a) > 1 else "" for r, a in arrived.items()}
        self.held_hosts = {r: a[2] if len(a) > 2 else "" for r, a in arrived.items()}
        return held

    def _forget(self, seq: int) -> None:
        """Delete sync ``seq``'s store keys (every rank entered a later sync, so none reads
        them again). Runs after the next sync's payloads, off the receivers' path; best
        effort: a store that fails here fails the next sync, which reports it."""
        g = self.group
        try:
            g.store.delete_key(header_key(g, seq))
            for r in range(g.world_size):
                for kind in SYNC_KEYS:
                    g.store.delete_key(g.key(kind, seq, r))
        except Exception:  # noqa: BLE001 - see docstring
            pass

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
        shm: ShmRefs | None = None,
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
            "shm": shm,
        }

    def _payloads(
        self,
        packed: PackedModel,
        base: PackedModel | None,
        plans: list[BucketPlan],
        progress: dict[str, int],
        refs: ShmRefs | None = None,
    ) -> None:
        """Broadcast every non-skipped bucket not in shared memory, encoding bucket i+1
        while i is in flight."""
        pending: deque[tuple[int, dist.Work, torch.Tensor]] = deque()
        for i, plan in enumerate(plans):
            if plan.kind is Kind.SKIP or plan.nbytes == 0 or (refs and refs[i] is not None):
                continue
            payload = self._encode(packed, base, i, plan)
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


def _or_none(version: int | None) -> int:
    return NO_VERSION if version is None else version


def plan_against(
    packed: PackedModel, base: PackedModel | None, mode: Mode
) -> tuple[Mode, list[BucketPlan]]:
    """Per-bucket plan of ``packed`` for receivers holding ``base`` (None: nothing);
    ``full`` when there is no usable base."""
    if base is None or base.manifest != packed.manifest:  # evicted, or the layout changed
        return Mode.FULL, [plan_bucket(Mode.FULL, new, None) for new in packed.buckets]
    return mode, [
        plan_bucket(mode, new, old) for new, old in zip(packed.buckets, base.buckets, strict=True)
    ]
