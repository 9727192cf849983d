"""The learner's end of the process-group broker: the sender endpoint held by learner
rank 0 while a broker is attached (asyncrl/learner/weights.py calls it), and by the
other learner ranks that send their own engine shards (direct).

    WeightBroker (Ray actor)                     learner rank 0
    start ── attach_broker ─────────────────▶ SenderSide.start: the endpoint ─▶ Attached
    publish(V) ── snapshot_weights ─────────▶ endpoint.snapshot(V) ─▶ Snapshot (a copy:
                                                 the learner may train on at once)
    per sync set ── send_weights(SendOrder) ─▶ [new group: open, ── Listening ──▶ broker,
                                                 members join] send ─▶ SendDone
      direct (order.tp > 1), shard t > 0 ────▶ [new group: join_tp at rank 0's port]
                                                 send_own ─▶ SendDone (rank 0 too)

``attach_broker`` and ``snapshot_weights`` run in the learner's own call queue (the
driver publishes between learner steps, so they never wait behind a step);
``send_weights`` runs in the learner's ``weights`` concurrency group (one thread), so
a transfer overlaps the next learner step.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.broker.messages import (
    Attached,
    Listening,
    SendDone,
    SendOrder,
    Snapshot,
    SnapshotOrder,
)
from asyncrl.broker.settings import BrokerSettings
from asyncrl.transport.broadcast import SendStats
from asyncrl.transport.endpoint import NamedTensors, SenderEndpoint
from asyncrl.transport.group import TransferError

log = logging.getLogger(__name__)


def default_host() -> str:
    import ray

    ip = ray.util.get_node_ip_address()
    # Local runs bind Ray to a loopback alias; the transport stays on 127.0.0.1.
    return "127.0.0.1" if ip.startswith("127.") else ip


def object_store_bytes() -> int:
    """This node's Ray object store capacity, 0 outside Ray: the weight segments in
    /dev/shm leave it free (the store's pages there are taken only as it fills)."""
    import ray

    if not ray.is_initialized():
        return 0
    node = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == node and n.get("Alive"):
            return int(n.get("Resources", {}).get("object_store_memory", 0))
    return 0


class SenderSide:
    """A sending rank's endpoint for one broker (``broker``: its Ray handle, told where
    a new group listens; ``shard``: the engine shard the rank sends on the direct path,
    its rank in the group). Every call is bounded by the endpoint's timeouts."""

    def __init__(
        self, broker_id: str, broker: Any, endpoint: SenderEndpoint, host: str, shard: int = 0
    ):
        self.broker_id = broker_id
        self.broker = broker
        self.endpoint = endpoint
        self.host = host
        self.shard = shard

    @classmethod
    def start(
        cls, broker_id: str, broker: Any, s: BrokerSettings, model_config: dict | None = None,
        shard: int = 0,
    ) -> SenderSide:  # fmt: skip
        """Rank 0's endpoint, or (``shard`` > 0) the sender of that engine shard's:
        shared memory is for rank 0's whole-model sends only."""
        host = s.host or default_host()
        shm = s.shm if shard == 0 else "off"
        endpoint = SenderEndpoint(
            host=host,
            backend=s.backend,
            timeout_s=s.timeout_s,
            join_timeout_s=s.join_timeout_s,
            bucket_mb=s.bucket_mb,
            shadow_device=s.shadow_device,
            max_versions=s.max_versions,
            model_config=model_config,
            shm=shm,
            shm_reserve_bytes=object_store_bytes() if shm != "off" else 0,
        )
        return cls(broker_id, broker, endpoint, host, shard)

    def attached(self, pid: int, tp: int = 1, cuts: bool = False) -> Attached:
        return Attached(self.host, self.endpoint.backend, pid, tp, cuts)

    def snapshot(
        self, order: SnapshotOrder, stream: NamedTensors, transient: bool = True
    ) -> Snapshot:
        info = self.endpoint.snapshot(
            order.version, stream, order.retain, order.with_digests, transient
        )
        return Snapshot(
            order.version, info["nbytes"], info["buckets"], info["pack_seconds"],
            info.get("digests"), order.tp,
        )  # fmt: skip

    def send(self, order: SendOrder) -> SendDone:
        """Open (or, the sender of a shard > 0, join) the group first when asked, then
        send; never raises."""
        key = order.key
        try:
            stats = self._send_own(order) if order.tp > 1 else self._send(order)
        except TransferError as e:
            self.endpoint.close(key)
            return SendDone(key, False, error=str(e), peer_ranks=e.peer_ranks, bucket=e.bucket)
        except Exception as e:  # noqa: BLE001 - reported to the broker, which decides
            self.endpoint.close(key)
            return SendDone(key, False, error=f"{type(e).__name__}: {e}")
        return SendDone(
            key, True, stats.bytes_sent, stats.bytes_full, stats.buckets_skipped,
            stats.buckets_sparse, stats.seconds, bytes_per_rank=stats.bytes_per_rank,
            shard_digests=stats.shard_digests, shm=stats.road == "shm",
            bytes_per_learner_rank=max(stats.bytes_per_learner_rank or [stats.bytes_sent]),
        )  # fmt: skip

    def _listen(self, order: SendOrder, tp: int = 1) -> None:
        key = order.key
        self.endpoint.open(
            key, order.open_world, tp=tp,
            on_listening=lambda port: self.broker.group_listening.remote(Listening(key, port)),
        )  # fmt: skip

    def _send(self, order: SendOrder) -> SendStats:
        """Rank 0 sends the whole model, or each engine worker its shard (``shards``)."""
        if order.open_world:
            self._listen(order)
        return self.endpoint.send(
            order.key, order.version, order.base, order.mode, order.arrive_timeout_s,
            order.shards, order.with_digests,
        )  # fmt: skip

    def _send_own(self, order: SendOrder) -> SendStats:
        """Direct: this rank sends its own engine shard (rank 0 hosts a new group, the
        others join it)."""
        if order.open_world:
            self._listen(order, order.tp)
        elif order.join_world:
            self.endpoint.join_tp(
                order.key, order.host, order.port, self.shard, order.join_world, order.tp
            )
        return self.endpoint.send_own(
            order.key, order.version, order.base, order.mode, order.arrive_timeout_s,
            order.with_digests,
        )  # fmt: skip

    def close(self, keys: tuple[str, ...] | None) -> None:
        if keys is None:
            self.endpoint.close_all()
        for key in keys or ():
            self.endpoint.close(key)

    def stop(self) -> None:
        self.endpoint.release()
