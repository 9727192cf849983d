"""The learner's end of the process-group broker: the sender endpoint held by learner
rank 0 while a broker is attached (asyncrl/learner/weights.py calls it).

    WeightBroker (Ray actor)                     learner rank 0
    start ── attach_broker ─────────────────▶ SenderSide.start: the endpoint ─▶ Attached
    publish(V) ── snapshot_weights ─────────▶ endpoint.snapshot(V) ─▶ Snapshot (a copy:
                                                 the learner may train on at once)
    per sync set ── send_weights(SendOrder) ─▶ [new group: open, ── Listening ──▶ broker,
                                                 members join] send ─▶ SendDone

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
    """Rank 0's endpoint for one broker (``broker``: its Ray handle, told where a new
    group listens). Every call is bounded by the endpoint's timeouts."""

    def __init__(self, broker_id: str, broker: Any, endpoint: SenderEndpoint, host: str):
        self.broker_id = broker_id
        self.broker = broker
        self.endpoint = endpoint
        self.host = host

    @classmethod
    def start(
        cls, broker_id: str, broker: Any, s: BrokerSettings, model_config: dict | None = None
    ) -> SenderSide:
        host = s.host or default_host()
        endpoint = SenderEndpoint(
            host=host,
            backend=s.backend,
            timeout_s=s.timeout_s,
            join_timeout_s=s.join_timeout_s,
            bucket_mb=s.bucket_mb,
            shadow_device=s.shadow_device,
            max_versions=s.max_versions,
            model_config=model_config,
            shm=s.shm,
            shm_reserve_bytes=object_store_bytes() if s.shm != "off" else 0,
        )
        return cls(broker_id, broker, endpoint, host)

    def attached(self, pid: int) -> Attached:
        return Attached(self.host, self.endpoint.backend, pid)

    def snapshot(self, order: SnapshotOrder, stream: NamedTensors) -> Snapshot:
        info = self.endpoint.snapshot(order.version, stream, order.retain, order.with_digests)
        return Snapshot(
            order.version, info["nbytes"], info["buckets"], info["pack_seconds"],
            info.get("digests"),
        )  # fmt: skip

    def send(self, order: SendOrder) -> SendDone:
        """Open the group first when asked, then send; never raises."""
        key = order.key
        try:
            if order.open_world:
                self.endpoint.open(
                    key,
                    order.open_world,
                    on_listening=lambda port: self.broker.group_listening.remote(
                        Listening(key, port)
                    ),
                )
            stats = self.endpoint.send(
                key, order.version, order.base, order.mode, order.arrive_timeout_s,
                order.shards, order.with_digests,
            )  # fmt: skip
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
        )  # fmt: skip

    def close(self, keys: tuple[str, ...] | None) -> None:
        if keys is None:
            self.endpoint.close_all()
        for key in keys or ():
            self.endpoint.close(key)

    def stop(self) -> None:
        self.endpoint.release()
