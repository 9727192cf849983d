"""The learner's end of the process-group broker: it runs inside the learner
process (rank 0, the sender), next to the weights.

    WeightBroker (Ray actor)                    learner process
    start ── __ray_call__(attach) ───────────▶ SenderEndpoint + command thread
    publish(V) ── __ray_call__(snapshot) ────▶ export(learner) ─▶ snapshot(V)  (a copy: the
                                                learner may train on as soon as it returns)
    per sync set: command ◀── long poll ─────── thread: next_command()
                                                  open(key, world)  ─▶ report {port}
                                                  send(key, V, base, mode)
                  report {done: stats|error} ◀─┘

Only ``attach`` and ``snapshot`` enter the learner's own call queue (the driver
calls ``publish`` between learner steps, so they never wait behind a step); the
transfer itself runs in the thread, overlapping the next learner step.

``publish_weights`` is the one function a learner needs: it takes any iterable
of ``(name, full tensor)`` (``model.state_dict().items()`` today, an FSDP
rank 0's ``named_parameters_stream()`` tomorrow).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncrl.transport.endpoint import SenderEndpoint
from asyncrl.transport.group import TransferError

log = logging.getLogger(__name__)

# Long-poll period: how long one next_command() call may wait for work. Short
# enough that a stop is noticed quickly, long enough to cost nothing when idle.
POLL_S = 2.0

_ENDPOINTS: dict[str, _CommandLoop] = {}


def publish_weights(
    broker_id: str,
    version: int,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    retain: Iterable[int] | None = None,
    with_digests: bool = False,
) -> dict[str, Any]:
    """Snapshot ``named_tensors`` as ``version`` for broker ``broker_id`` (in this
    process, which must be the attached learner rank 0). Returns the snapshot
    info (bytes, buckets, seconds, optional per-tensor digests)."""
    loop = _ENDPOINTS.get(broker_id)
    if loop is None:
        raise RuntimeError(
            f"broker {broker_id} is not attached to this process (pid {os.getpid()})"
        )
    return loop.endpoint.snapshot(version, named_tensors, retain, with_digests)


def export_state(learner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Default export: ``learner.model.state_dict()``, each tensor once (a tied LM
    head shares the embedding's storage and vLLM ties it itself)."""
    seen: set[tuple] = set()
    for name, t in learner.model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        yield name, t.detach()


# ---- entry points run inside the learner via ``learner.__ray_call__`` ------------------
def attach(learner: Any, broker_id: str, broker: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Start this process's sender endpoint and its command thread."""
    old = _ENDPOINTS.pop(broker_id, None)
    if old is not None:
        old.stop()
    host = settings.get("host") or _default_host()
    endpoint = SenderEndpoint(
        host=host,
        backend=settings.get("backend", "auto"),
        timeout_s=settings["timeout_s"],
        join_timeout_s=settings.get("join_timeout_s"),
        bucket_mb=settings["bucket_mb"],
        shadow_device=settings.get("shadow_device"),
        max_versions=settings.get("max_versions", 4),
    )
    loop = _CommandLoop(broker_id, broker, endpoint)
    _ENDPOINTS[broker_id] = loop
    loop.start()
    return {"host": host, "backend": endpoint.backend, "pid": os.getpid()}


Export = Callable[[Any], Iterable[tuple[str, torch.Tensor]]]


def weight_stream(learner: Any, export: Export | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """The learner's ``(HF name, full tensor)`` stream: ``export(learner)`` if given,
    else its ``named_parameters_stream()`` (collective on a sharded learner: every
    rank must iterate it), else :func:`export_state`."""
    if export is not None:
        return export(learner)
    if hasattr(learner, "named_parameters_stream"):
        return learner.named_parameters_stream()
    return export_state(learner)


def snapshot(
    learner: Any,
    broker_id: str,
    version: int,
    retain: list[int],
    with_digests: bool,
    export: Export | None = None,
) -> dict[str, Any]:
    """Rank 0: snapshot the learner's weights as ``version``."""
    return publish_weights(broker_id, version, weight_stream(learner, export), retain, with_digests)


def drain(learner: Any, export: Export | None = None) -> None:
    """Ranks > 0: take part in the collective stream rank 0 is snapshotting."""
    for _ in weight_stream(learner, export):
        pass


def detach(learner: Any, broker_id: str) -> None:
    loop = _ENDPOINTS.pop(broker_id, None)
    if loop is not None:
        loop.stop()


def learner_digests(learner: Any, export: Export | None = None) -> dict[str, str]:
    """Per-tensor digests of the learner's live weights (bit-exactness checks); on
    a sharded learner every rank must call it, and ranks > 0 get nothing useful."""
    from asyncrl.transport.endpoint import digests

    return digests(weight_stream(learner, export))


def _default_host() -> str:
    import ray

    ip = ray.util.get_node_ip_address()
    # Local runs bind Ray to a loopback alias; the transport stays on 127.0.0.1.
    return "127.0.0.1" if ip.startswith("127.") else ip


class _CommandLoop:
    """Daemon thread: long-polls the broker for commands and runs them in order.

    Loop: ``next_command(POLL_S)`` (returns None when idle) → run it → report.
    Exits on ``stop``, on the ``stop`` command, or when the broker is gone.
    """

    def __init__(self, broker_id: str, broker: Any, endpoint: SenderEndpoint):
        self.broker_id = broker_id
        self.broker = broker
        self.endpoint = endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"asyncrl-send-{broker_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

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
        if _ENDPOINTS.get(self.broker_id) is self:
            del _ENDPOINTS[self.broker_id]

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
