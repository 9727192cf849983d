"""The learner's end of the process-group broker: a sender endpoint and the thread that
serves the broker's commands, held by learner rank 0 (``Learner._sender``, attached
through ``Learner.attach_broker``; learner/weights.py).

    WeightBroker (Ray actor)                    learner rank 0
    start ── attach_broker ─────────────────▶ SenderLoop.start: endpoint + command thread
    publish(V) ── snapshot_weights ─────────▶ endpoint.snapshot(V)  (a copy: the learner
                                                may train on as soon as it returns)
    per sync set: command ◀── long poll ─────── thread: next_command()
                                                  open(key, world)  ─▶ report {port}
                                                  send(key, V, base, mode)
                  report {done: stats|error} ◀─┘

Only ``attach_broker`` and ``snapshot_weights`` enter the learner's own call queue (the
driver publishes between learner steps, so they never wait behind a step); the transfer
itself runs in the thread, overlapping the next learner step.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from asyncrl.transport.endpoint import SenderEndpoint
from asyncrl.transport.group import TransferError

log = logging.getLogger(__name__)

# Long-poll period: how long one next_command() call may wait for work. Short
# enough that a stop is noticed quickly, long enough to cost nothing when idle.
POLL_S = 2.0


def default_host() -> str:
    import ray

    ip = ray.util.get_node_ip_address()
    # Local runs bind Ray to a loopback alias; the transport stays on 127.0.0.1.
    return "127.0.0.1" if ip.startswith("127.") else ip


class SenderLoop:
    """Daemon thread: long-polls the broker for commands and runs them in order.

    Loop: ``next_command(POLL_S)`` (returns None when idle) → run it → report.
    Exits on ``stop``, on the ``stop`` command, or when the broker is gone.
    """

    def __init__(self, broker_id: str, broker: Any, endpoint: SenderEndpoint, host: str):
        self.broker_id = broker_id
        self.broker = broker
        self.endpoint = endpoint
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"asyncrl-send-{broker_id}", daemon=True
        )

    @classmethod
    def start(cls, broker_id: str, broker: Any, settings: dict[str, Any]) -> SenderLoop:
        """An endpoint for ``settings`` (BrokerSettings' fields) and its running thread."""
        host = settings.get("host") or default_host()
        endpoint = SenderEndpoint(
            host=host,
            backend=settings.get("backend", "auto"),
            timeout_s=settings["timeout_s"],
            join_timeout_s=settings.get("join_timeout_s"),
            bucket_mb=settings["bucket_mb"],
            shadow_device=settings.get("shadow_device"),
            max_versions=settings.get("max_versions", 4),
        )
        loop = cls(broker_id, broker, endpoint, host)
        loop._thread.start()
        return loop

    def stop(self) -> None:
        self._stop.set()
        self.endpoint.close_all()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                cmd = ray.get(self.broker.next_command.remote(POLL_S), timeout=POLL_S + 60)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - the broker is gone: nothing left to serve
                log.warning("weight broker %s unreachable, sender stops: %s", self.broker_id, e)
                break
            if cmd is None:
                continue
            if cmd["op"] == "stop":
                break
            self._execute(cmd)
        self.endpoint.close_all()

    def _execute(self, cmd: dict[str, Any]) -> None:
        if cmd["op"] == "close":
            for key in cmd["keys"]:
                self.endpoint.close(key)
            return
        cid = cmd["id"]
        try:
            if cmd.get("world"):
                self.endpoint.open(
                    cmd["key"],
                    cmd["world"],
                    on_listening=lambda port: self.broker.report.remote(cid, "port", port),
                )
            stats = self.endpoint.send(cmd["key"], cmd["version"], cmd["base"], cmd["mode"])
            result: dict[str, Any] = {"ok": True, **dataclasses.asdict(stats)}
        except TransferError as e:
            self.endpoint.close(cmd["key"])
            result = {
                "ok": False,
                "error": str(e),
                "peer_ranks": list(e.peer_ranks),
                "bucket": e.bucket,
            }
        except Exception as e:  # noqa: BLE001 - reported, never raised in a daemon thread
            self.endpoint.close(cmd["key"])
            result = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "peer_ranks": [],
                "bucket": None,
            }
        self.broker.report.remote(cid, "done", result)


class CommandQueue:
    """The broker's half of the command channel: commands wait here for the sender
    thread's long poll (one consumer); results come back through ``report``."""

    def __init__(self) -> None:
        import asyncio
        import collections

        self._cmds: collections.deque[dict[str, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._waiters: dict[int, dict[str, Any]] = {}

    async def next(self, timeout_s: float) -> dict[str, Any] | None:
        import asyncio

        if not self._cmds:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return None
        return self._cmds.popleft() if self._cmds else None

    def report(self, cid: int, kind: str, value: Any) -> None:
        fut = self._waiters.get(cid, {}).get(kind)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def post(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Queue ``cmd``; with an ``id``, futures for its ``port`` and ``done`` reports."""
        import asyncio

        loop = asyncio.get_running_loop()
        futs: dict[str, Any] = {}
        if "id" in cmd:
            futs = {"port": loop.create_future(), "done": loop.create_future()}
            self._waiters[cmd["id"]] = futs
        self._cmds.append(cmd)
        self._ready.set()
        return futs

    def forget(self, cid: int) -> None:
        self._waiters.pop(cid, None)
