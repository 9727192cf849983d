"""Weight updates on a running engine (asyncrl/engine/protocol.py ``Engine``): how a
rollout actor receives weights.

    WeightUpdates.load_state_dict(state, V)   object-store path: the state dict to a
                                safetensors file in /dev/shm ──▶ paused_update(reload it)
    WeightUpdates.receive(order)   process-group path (the broker's ReceiveOrder):
                                paused_update(sync_workers) ──▶ Reloaded
    sync_workers(order):        engine.receive_weights: every worker joins (first use),
                                receives and reloads in place ──▶ its ReceiveReport
    paused_update(load, V):     pause(mode) ──▶ load() ──▶ label V ──▶ (reset prefix
                                cache) ──▶ resume   (resume runs in `finally`)

One update at a time per engine (``WeightUpdates`` holds the lock).

Update modes (what happens to requests in flight when weights change):
``abort`` drops them (the actor runs the episode again from its prompt) and clears
the KV/prefix cache; ``wait`` lets them finish first and clears the cache;
``keep`` freezes them with their KV and continues them on the new weights
(tokens are labelled with the version that sampled them, so a sequence spans
versions). With prefix caching on, ``keep`` preempts the kept requests when it
resets the prefix cache (vLLM cannot drop cached blocks that requests hold):
their tokens are kept, their KV is recomputed with the new weights, and no
request ever reads a cached prefix of an older version.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.broker.messages import Loaded, ReceiveOrder, Reloaded
from asyncrl.engine.protocol import Engine
from asyncrl.transport.spec import JoinSpec, ReceiveReport

# Bound on one small control RPC (state, clock, resume); a live engine answers in ms.
RPC_TIMEOUT_S = 60.0


# How often a pending RPC checks whether the engine died (a dead engine core may
# never answer the call; vLLM's monitor thread flags it within moments).
DEAD_CHECK_S = 0.1


class EngineGone(RuntimeError):
    """The engine's core process died while we were talking to it."""


async def rpc(
    engine: Engine,
    method: str,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = RPC_TIMEOUT_S,
) -> list:
    """``engine.call_workers`` with a client-side deadline (one result per worker);
    raises :class:`EngineGone` as soon as the engine is known dead."""
    return await until_answered(
        engine, engine.call_workers(method, kwargs, timeout_s), timeout_s, method
    )


async def until_answered(engine: Engine, call: Awaitable[Any], timeout_s: float, what: str) -> Any:
    """Await ``call`` (an engine call) for at most ``timeout_s``; raise :class:`EngineGone`
    within ``DEAD_CHECK_S`` of the engine being known dead: a call its dead core never
    answers must not hold a weight sync for the whole pause timeout (300 s by default)."""
    task = asyncio.ensure_future(call)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DEAD_CHECK_S)
            if done:
                return task.result()
            if engine_dead(engine):
                raise EngineGone(f"the engine died during {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} got no answer within {timeout_s:.0f}s")
    finally:
        if not task.done():
            task.cancel()


class WorkersFailed(RuntimeError):
    """A worker's receive failed: its report names the bucket and the peers."""

    def __init__(self, report: ReceiveReport, held: int):
        super().__init__(report.error)
        self.report, self.held = report, held


async def sync_workers(engine: Engine, order: ReceiveOrder) -> list[ReceiveReport]:
    """One ``receive_weights`` call to every worker (join, receive, reload in place;
    ``order.engine_api=vllm``: the engine's own update API, which also sets its weight
    version), bounded by ``order.deadline_s``. Raises :class:`WorkersFailed` when a worker's
    receive did."""
    spec = JoinSpec(
        order.key, order.host, order.port, order.rank, order.world_size, order.timeout_s,
        order.join_timeout_s, order.backend, order.hold_copy,
    )  # fmt: skip
    if order.engine_api == "vllm":  # the engine's own update API (engine/vllm_transfer.py)
        what = "vLLM's weight update"
        call = engine.receive_weights_via_engine(
            spec, order.version, order.with_digests, order.deadline_s
        )
    else:
        what = "asyncrl_sync"
        call = engine.receive_weights(spec, order.with_digests, order.deadline_s)
    reports = await until_answered(engine, call, order.deadline_s, what)
    for r in reports:
        if not r.ok:
            raise WorkersFailed(r, min(x.held for x in reports))
    return reports


async def paused_update(
    engine: Engine,
    mode: str,
    version: int,
    load: Callable[[], Awaitable[Any]],
    prefix_caching: bool,
    pause_timeout_s: float,
    labelled: Callable[[int], None] | None = None,
    hops: dict[str, float] | None = None,
) -> tuple[Any, float]:
    """Pause per ``mode``, ``await load()``, label ``version`` (then ``labelled(version)``),
    resume. Returns (load's result, seconds paused as this caller sees it: pause sent to
    resume answered). Generation is resumed even when anything fails. ``hops`` (if
    given) gets the seconds of each step: ``pause`` (not under ``keep``), ``load``
    (under ``keep`` with the pause), ``resume`` (with the label), and on a real engine
    under ``keep`` ``engine_paused``: from the engine core reading the pause to its
    reading the resume, by its own clock (docs/weight_sync.md).

    The engine core reads its input in order, and under ``keep`` it runs no step from
    the moment it reads the pause: the load's call follows the pause's without waiting
    for its reply, and after the load the label, the prefix-cache reset and the resume
    go out together: two round trips to the engine core. What the caller sees also
    holds the engine step in progress when the pause was sent and the resume's answer
    coming back (both while the engine generates)."""
    t0 = time.monotonic()
    marks = {"start": t0}
    clock = engine.worker_clocks if mode == "keep" and engine.timed_pause else None
    resumed, before, after = False, None, None
    try:
        if mode == "keep":  # the pause takes effect at once: the load may follow it
            sent = await _send_in_order(([clock()] if clock else []) + [engine.pause(mode)])
            result = await load()
            got = await until_answered(engine, _all(sent), pause_timeout_s, "the pause")
            before = got[0] if clock else None
        else:  # abort and wait: the engine drains first (wait: still stepping)
            await until_answered(engine, engine.pause(mode), pause_timeout_s, "the pause")
            marks["pause"] = time.monotonic()
            result = await load()
        marks["load"] = time.monotonic()
        # Every token the engine produces from here on is labelled `version`.
        calls = [engine.label(version)]
        if mode == "keep" and prefix_caching:
            calls.append(engine.reset_prefix_cache(running=True))
        if clock:
            calls.append(clock())  # read just before the resume, in the same gap
        resumed = True  # the resume is among these calls: `finally` must not send another
        sent = await _send_in_order([*calls, engine.resume()])
        got = await until_answered(engine, _all(sent), RPC_TIMEOUT_S, "the resume")
        after = got[-2] if clock else None
        if labelled is not None:
            labelled(version)
    finally:
        if not resumed and not engine_dead(engine):
            await until_answered(engine, engine.resume(), RPC_TIMEOUT_S, "the resume")
        marks["resume"] = time.monotonic()
    if hops is not None:
        hops.update(_spans(marks))
        if before and after:  # one reading per worker: the slowest worker's pause
            hops["engine_paused"] = max(b - a for a, b in zip(before, after))
    return result, marks["resume"] - t0


async def _send_in_order(coros: list[Awaitable[Any]]) -> list[asyncio.Future]:
    """Start each engine call in turn: each sends its message in its first slice, so
    they reach the engine core in this order. Returns the calls (await :func:`_all`)."""
    tasks = []
    for c in coros:
        tasks.append(asyncio.ensure_future(c))
        await asyncio.sleep(0)  # the task's first slice: its message is sent
    return tasks


async def _all(tasks: list[asyncio.Future]) -> list[Any]:
    """Every call's result; the first error is raised once every call is done."""
    got = await asyncio.gather(*tasks, return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got


def _spans(marks: dict[str, float]) -> dict[str, float]:
    """Consecutive marks (insertion order) -> the seconds between each and the one before."""
    names, times = list(marks), list(marks.values())
    return {names[i]: times[i] - times[i - 1] for i in range(1, len(names))}


def engine_dead(engine: Engine | None, exc: BaseException | None = None) -> bool:
    """True when the engine can never serve again (its core process died)."""
    if engine is None or engine.errored:
        return True
    return isinstance(exc, EngineGone) or type(exc).__name__ == "EngineDeadError"


class WeightUpdates:
    """One engine's weight updates, one at a time, each ending in
    :func:`paused_update`. ``labelled(version)`` runs as soon as the engine labels
    new tokens with ``version`` (the actor tells its queue). Each call takes the
    engine and the update mode of the moment."""

    def __init__(self, name: str, prefix_caching: bool, labelled: Callable[[int], None]):
        self.name = name
        self.prefix_caching = prefix_caching
        self.labelled = labelled
        self._lock = asyncio.Lock()

    async def _paused(
        self,
        engine: Engine,
        mode: str,
        version: int,
        load,
        pause_timeout_s: float = 600.0,
        hops: dict[str, float] | None = None,
    ) -> tuple[Any, float]:
        return await paused_update(
            engine, mode, version, load, self.prefix_caching, pause_timeout_s, self.labelled,
            hops,
        )  # fmt: skip

    async def load_state_dict(self, engine: Engine, mode: str, state: dict, version: int) -> Loaded:
        """Load ``state`` (name -> tensor) as ``version``: written once to a
        safetensors file the workers reload from (tensors cannot travel as RPC
        arguments)."""
        from safetensors.torch import save_file

        async with self._lock:
            t0 = time.time()
            fd, path = tempfile.mkstemp(
                prefix=f"asyncrl-{self.name}-", suffix=".safetensors", dir=_shm_dir()
            )
            os.close(fd)
            try:
                save_file({k: v.contiguous() for k, v in state.items()}, path)
                await self._paused(
                    engine,
                    mode,
                    version,
                    lambda: until_answered(
                        engine, engine.load_weights_file(path, 600.0), 600.0, "asyncrl_load_file"
                    ),
                )
            finally:
                os.unlink(path)
            return Loaded(version, time.time() - t0)

    async def receive(self, engine: Engine, mode: str, order: ReceiveOrder) -> Reloaded:
        """Take part in one process-group sync: pause generation (per ``mode``), one call
        that has every worker receive and reload in place, label, resume. Never raises:
        the answer says ``ok``, or the error and whether the engine is ``dead``."""
        # wall clock (the broker's is the same on one machine): its order's trip here
        out = Reloaded(self.name, order.version, t_enter=time.time(), update_mode=mode)
        async with self._lock:
            t0 = time.monotonic()
            try:
                reports, out.pause_call_seconds = await self._paused(
                    engine, mode, order.version, lambda: sync_workers(engine, order),
                    order.pause_timeout_s, out.hops,
                )  # fmt: skip
            except WorkersFailed as e:
                r = e.report
                out.held, out.error, out.bucket, out.peer_ranks = (
                    e.held,
                    r.error,
                    r.bucket,
                    r.peer_ranks,
                )
                return out
            except Exception as e:  # noqa: BLE001 - reported to the broker, which decides
                out.error, out.dead = f"{type(e).__name__}: {e}", engine_dead(engine, e)
                return out
            _fill(out, reports)
            out.seconds = time.monotonic() - t0
            out.t_exit = time.time()
            return out


def _fill(out: Reloaded, reports: list[ReceiveReport]) -> None:
    """A successful update's figures from its workers' reports (the slowest worker's)."""
    out.ok = True
    out.held = min(r.held for r in reports)
    out.bytes = reports[0].bytes
    out.transfer_seconds = max(r.seconds for r in reports)
    out.reload_seconds = max(r.reload_seconds for r in reports)
    out.hops["receive"] = out.transfer_seconds
    # the engine's own view where it has one: the caller's also holds the end of the
    # step in progress and the resume's answer (still generating)
    out.pause_seconds = out.hops.get("engine_paused", out.pause_call_seconds)
    if any(r.digests is not None for r in reports):
        out.digests = [r.digests for r in reports]


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None
