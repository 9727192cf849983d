"""The bookkeeping of one process-group sync (pure: no Ray, no torch): the group a sync
set broadcasts in, the tally of one published version and its metrics, and how the
broker reads the sender's and the receivers' reports."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from asyncrl.broker.messages import Reloaded, SendDone, Snapshot
from asyncrl.broker.plan import ActorView
from asyncrl.transport.spec import HEADER_BUCKET


@dataclass
class Group:
    """One cached process group: the learner's sending ranks (rank 0, or the ``senders``
    ranks each sending their own engine shard) and the members' workers."""

    key: str
    ranks: dict[str, int]  # first rank of each member's workers
    world: int
    senders: int = 1
    port: int = 0
    listening: asyncio.Future | None = None  # a new group: rank 0's port, once bound


@dataclass
class SyncTally:
    """Accounting of one sync (one published version)."""

    version: int
    t0: float
    pack_seconds: float = 0.0
    weights_bytes: int = 0  # the snapshot's size (every tensor, once)
    bytes_sent: int = 0
    bytes_full: int = 0
    bytes_per_engine_rank: int = 0  # the most one engine worker received (max over sets)
    bytes_per_learner_rank: int = 0  # the most one learner rank sent to a set (max over sets)
    buckets_skipped: int = 0
    buckets_sparse: int = 0
    transfer_seconds: float = 0.0
    pause_max: float = 0.0  # the engine's pause (its own clock where it has one)
    pause_call_max: float = 0.0  # the actor's view: pause sent to resume answered
    reload_max: float = 0.0  # the bare in-place reload inside the engine, slowest actor
    # per actor-side step of an update (actor/weights.py: receive, pause, load, label,
    # resume): the slowest actor's seconds
    hops: dict[str, float] = field(default_factory=dict)
    t_ordered: float = 0.0  # wall clock: the last set's orders went to its actors
    sets: int = 0
    shm_sets: int = 0  # sets whose payloads went through shared memory
    updated: int = 0
    errors: list[str] = field(default_factory=list)

    def add_sender(self, sender: SendDone) -> None:
        """Count one set's transfer from the sender's report."""
        self.sets += 1
        if sender.ok:
            self.bytes_sent += sender.bytes_sent
            self.bytes_full += sender.bytes_full
            self.bytes_per_engine_rank = max(self.bytes_per_engine_rank, sender.bytes_per_rank)
            self.bytes_per_learner_rank = max(
                self.bytes_per_learner_rank, sender.bytes_per_learner_rank
            )
            self.buckets_skipped += sender.buckets_skipped
            self.buckets_sparse += sender.buckets_sparse
            self.transfer_seconds += sender.seconds
            self.shm_sets += sender.shm

    def add_actor(self, res: Reloaded, t_back: float) -> None:
        """Count one actor's successful update from its answer (``t_back``: when it came)."""
        self.updated += 1
        self.pause_max = max(self.pause_max, res.pause_seconds)
        self.pause_call_max = max(self.pause_call_max, res.pause_call_seconds)
        self.reload_max = max(self.reload_max, res.reload_seconds)
        hops = dict(res.hops)
        if self.t_ordered and res.t_enter:  # the Ray calls' trips, both ways
            hops["order"] = res.t_enter - self.t_ordered
            hops["reply"] = t_back - res.t_exit
        for k, v in hops.items():
            self.hops[k] = max(self.hops.get(k, 0.0), v)

    def metrics(self, seconds: float, dead: int) -> dict[str, float]:
        gbps = self.bytes_sent / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0
        return {
            "broker/sync_seconds": seconds,
            "broker/weights_bytes": float(self.weights_bytes),
            "broker/bytes_sent": float(self.bytes_sent),
            "broker/bytes_full": float(self.bytes_full),
            "broker/bytes_per_engine_rank": float(self.bytes_per_engine_rank),
            "broker/bytes_per_learner_rank": float(self.bytes_per_learner_rank),
            "broker/buckets_skipped": float(self.buckets_skipped),
            "broker/buckets_sparse": float(self.buckets_sparse),
            "broker/transfer_seconds": self.transfer_seconds,
            "broker/gbps": gbps,
            "broker/pack_seconds": self.pack_seconds,
            "broker/pause_seconds_max": self.pause_max,
            "broker/pause_call_seconds_max": self.pause_call_max,
            "broker/reload_seconds": self.reload_max,
            **{f"broker/hop/{k}_seconds": v for k, v in self.hops.items()},
            "broker/sets": float(self.sets),
            "broker/shm_sets": float(self.shm_sets),
            "broker/actors_updated": float(self.updated),
            "broker/errors": float(len(self.errors)),
            "broker/dead": float(dead),
        }


def combine_snapshots(snaps: list[Snapshot]) -> Snapshot:
    """The sending learner ranks' snapshots of their own engine shards (``snaps[r]``:
    engine shard ``r``'s) as one: every shard's bytes, the most buckets (a transfer's deadline), the
    slowest pack; the digests keyed ``<rank>/<name>`` (with ``verify``)."""
    digests = None
    if all(s.digests is not None for s in snaps):
        digests = {f"{r}/{k}": v for r, s in enumerate(snaps) for k, v in s.digests.items()}
    return Snapshot(
        snaps[0].version, sum(s.nbytes for s in snaps), max(s.buckets for s in snaps),
        max(s.pack_seconds for s in snaps), digests, snaps[0].tp,
    )  # fmt: skip


def combine_sends(dones: list[SendDone]) -> SendDone:
    """One set's transfer from its senders' reports (``dones[r]``: engine shard ``r``'s).
    Rank 0's counts every rank's bytes; bucket counts add up; the slowest rank's
    seconds; each rank's shard digests in rank order. Failed: every failing rank named
    in one line, its peers and the first failing bucket."""
    if len(dones) == 1:
        return dones[0]
    head = dones[0]
    bad = [(r, d) for r, d in enumerate(dones) if not d.ok]
    if bad:
        return SendDone(
            head.key, False,
            error=" | ".join(f"sender of engine shard {r}: {d.error}" for r, d in bad),
            peer_ranks=tuple(sorted({p for r, d in bad for p in d.peer_ranks or (r,)})),
            bucket=bad[0][1].bucket,
        )  # fmt: skip
    shards = [d.shard_digests for d in dones]
    return SendDone(
        head.key, True, head.bytes_sent, head.bytes_full,
        sum(d.buckets_skipped for d in dones), sum(d.buckets_sparse for d in dones),
        max(d.seconds for d in dones), bytes_per_rank=head.bytes_per_rank,
        shard_digests=None if None in shards else [s for one in shards for s in one],
        bytes_per_learner_rank=max(d.bytes_per_learner_rank for d in dones),
    )  # fmt: skip


def culprits(group: Group, sender: SendDone, views: dict[str, ActorView]) -> set[str]:
    """The members whose workers hold a rank the sender named as the failing peer."""
    peers = set(sender.peer_ranks)
    out = set()
    for name, first in group.ranks.items():
        if peers & set(range(first, first + views.get(name, ActorView(0)).workers)):
            out.add(name)
    return out


def digest_mismatch(
    name: str, res: Reloaded, snap: Snapshot, shards: list[dict[str, str]] | None = None
) -> str | None:
    """With ``verify``: a message unless every worker of ``name`` loaded exactly the
    snapshot's bytes, or (resharded: ``shards``, the sender's digests per engine TP
    rank) exactly its shard's (None without digests)."""
    if not snap.digests:
        return None
    for w, got in enumerate(res.digests or [None]):
        want = shards[w % len(shards)] if shards else snap.digests
        if got != want:
            got = got or {}
            diff = sorted(k for k in set(want) | set(got) if got.get(k) != want.get(k))
            return (
                f"actor {name!r} worker {w} loaded version {snap.version} "
                f"with different bytes in {diff[:5]} ({len(diff)} tensors)"
            )
    return None


def where(bucket: int | None) -> str:
    if bucket is None:
        return "setup"
    return "header" if bucket == HEADER_BUCKET else f"bucket {bucket}"
