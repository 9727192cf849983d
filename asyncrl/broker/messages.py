"""The messages of a process-group weight sync: one dataclass each, with a ``kind``,
each sent straight to the party that acts on it (a Ray call's argument or its answer).

    WeightBroker ── SnapshotOrder ──▶ every learner rank (its call queue)  ─▶ Snapshot
    WeightBroker ── SendOrder ──────▶ learner rank 0 (its weights thread) ─▶ SendDone
                    (a new group first: rank 0 ── Listening ──▶ WeightBroker)
        direct (``tp`` > 1): also to the senders of engine shards 1..tp-1 (learner
                    ranks), each sending its own; they join once rank 0 listens
    WeightBroker ── ReceiveOrder ───▶ each actor of the set ─▶ Reloaded
    WeightBroker ── CloseGroups ────▶ rank 0 and the actors (a group left the cache)
    (object store) ── update_weights([ref], V) ──▶ each actor ─▶ Loaded

The worker side (inside vLLM) speaks transport's ``JoinSpec`` / ``ReceiveReport``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION

# Learner rank 0 takes SendOrder and CloseGroups in this concurrency group of its Ray
# actor (one thread), beside its default queue where train steps and snapshots run in
# order; the rank's actor class is made with CONCURRENCY_GROUPS.
WEIGHTS_GROUP = "weights"
CONCURRENCY_GROUPS = {WEIGHTS_GROUP: 1}


@dataclass(frozen=True)
class SnapshotOrder:
    """Pack the learner's weights as ``version`` (a copy: it may train on at once);
    drop shadows other than ``retain`` first; digest them with ``with_digests``.
    ``tp`` > 1 (direct): learner rank ``senders[t]`` packs only engine rank ``t``'s shard
    of ``tp`` (``WeightsOut.engine_shard``; asyncrl/transport/reshard.py
    ``direct_senders``), not rank 0 the whole model; the other ranks take part in the
    collective unshard."""

    broker_id: str
    version: int
    retain: tuple[int, ...] = ()
    with_digests: bool = False
    tp: int = 0
    senders: tuple[int, ...] = ()
    kind: str = "snapshot"


@dataclass(frozen=True)
class Snapshot:
    """What a snapshot holds: ``nbytes`` in ``buckets``; per-tensor ``digests`` if asked.
    ``tp`` > 1: the sending learner ranks each hold their own engine shard (the broker's
    sum of their snapshots: every shard's bytes, the most buckets, the slowest pack)."""

    version: int
    nbytes: int = 0
    buckets: int = 1
    pack_seconds: float = 0.0
    digests: dict[str, str] | None = None
    tp: int = 0
    kind: str = "snapshot_done"


@dataclass(frozen=True)
class Attached:
    """A learner rank's answer to ``attach_broker``: where workers connect, and how.
    ``cuts``: the learner's ranks can cut engine shards themselves (a sharded learner
    without LoRA: the direct path); ``tp``: its ``learner.tp``."""

    host: str
    backend: str
    pid: int
    tp: int = 1
    cuts: bool = False
    kind: str = "attached"


@dataclass(frozen=True)
class SendOrder:
    """Bring group ``key`` (every member holding ``base``) to ``version`` in ``mode``.
    ``open_world`` > 0: host the group first (port announced with :class:`Listening`).
    ``arrive_timeout_s``: how long the members may take to enter the sync (they
    pause generation first, which under ``wait`` lets requests finish)."""

    key: str
    version: int
    base: int
    mode: str
    arrive_timeout_s: float
    open_world: int = 0
    shards: int = 0  # > 1: the members' engines have this many TP workers; each gets its shard
    with_digests: bool = False  # resharded: the shards' digests come back (broker.verify)
    # > 1: the learner ranks sending engine shards 0..tp-1 (group ranks 0..tp-1) each send
    # their own; a rank > 0 of a new group (``join_world`` > 0) first joins it at rank 0's
    # ``host``:``port``
    tp: int = 0
    host: str = ""
    port: int = 0
    join_world: int = 0
    kind: str = "send"


@dataclass(frozen=True)
class Listening:
    """Rank 0 hosts group ``key`` at ``port`` and waits for its members to join."""

    key: str
    port: int
    kind: str = "listening"


@dataclass
class SendDone:
    """A sending rank's end of one set's transfer: its stats, or the error naming the
    failing peer ranks and the bucket (``HEADER_BUCKET``: before the payload; None:
    setup). Direct (``SendOrder.tp`` > 1): rank 0's bytes are the whole sync's, the
    other senders' their own; ``bytes_per_learner_rank`` is the most one rank sent."""

    key: str
    ok: bool
    bytes_sent: int = 0
    bytes_full: int = 0
    buckets_skipped: int = 0
    buckets_sparse: int = 0
    seconds: float = 0.0
    error: str = ""
    peer_ranks: tuple[int, ...] = ()
    bucket: int | None = None
    bytes_per_rank: int = 0  # what one engine worker received (its shard when resharded)
    shard_digests: list[dict[str, str]] | None = None  # resharded, asked: per engine TP rank
    shm: bool = False  # the payloads went through shared memory (transport/shm.py)
    bytes_per_learner_rank: int = 0  # the most one learner rank sent
    kind: str = "send_done"

    @classmethod
    def missing(cls, key: str, stage: str, rank: int = 0) -> SendDone:
        """Learner rank ``rank`` never answered ``stage`` in time: it is the culprit."""
        return cls(
            key, False,
            error=f"learner rank {rank} did not report the {stage} in time (dead or stuck)",
            peer_ranks=(rank,), bucket=HEADER_BUCKET,
        )  # fmt: skip


@dataclass(frozen=True)
class ReceiveOrder:
    """Take part in group ``key``'s next sync (of ``version``) as ranks from ``rank``
    on (one per worker), pausing generation per the actor's update mode around it.
    ``deadline_s`` bounds the whole call to the workers (join, transfer, reload)."""

    key: str
    host: str
    port: int
    rank: int
    world_size: int
    version: int
    backend: str
    timeout_s: float
    join_timeout_s: float
    pause_timeout_s: float
    deadline_s: float
    hold_copy: bool = True
    with_digests: bool = False
    engine_api: str = "asyncrl"  # asyncrl: the worker extension's call; vllm: vLLM's API
    kind: str = "receive"


@dataclass
class Reloaded:
    """An actor's end of one sync: ``ok`` (every worker loaded ``version``), or the error,
    the bucket it failed at and whether the engine is ``dead``. ``held``: the version its
    workers keep for deltas (the minimum over workers). Timings in seconds; ``t_enter`` /
    ``t_exit`` are wall-clock stamps of the call (the order's and the reply's trips)."""

    name: str
    version: int
    ok: bool = False
    held: int = NO_VERSION
    error: str = ""
    bucket: int | None = None
    peer_ranks: tuple[int, ...] = ()
    dead: bool = False
    bytes: int = 0
    transfer_seconds: float = 0.0  # the slowest worker's join + receive
    reload_seconds: float = 0.0  # the slowest worker's bare in-place reload
    pause_seconds: float = 0.0  # the engine's own view where it has one
    pause_call_seconds: float = 0.0  # the actor's view: pause sent to resume answered
    seconds: float = 0.0
    hops: dict[str, float] = field(default_factory=dict)
    digests: list[dict[str, str] | None] | None = None
    t_enter: float = 0.0
    t_exit: float = 0.0
    update_mode: str = ""  # the actor's at this update
    kind: str = "reloaded"


@dataclass(frozen=True)
class Loaded:
    """An actor's end of one object-store update: ``version`` loaded in ``seconds``."""

    version: int
    seconds: float
    kind: str = "loaded"


@dataclass(frozen=True)
class WeightState:
    """An actor's versions: ``version`` labels its tokens, ``held`` the copy its workers
    keep for deltas (minimum over its ``workers``)."""

    name: str
    version: int
    held: int
    workers: int
    update_mode: str
    fatal: str = ""
    kind: str = "weight_state"


@dataclass(frozen=True)
class CloseGroups:
    """Close groups ``keys`` (None: every group)."""

    keys: tuple[str, ...] | None = None
    kind: str = "close_groups"
