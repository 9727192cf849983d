"""Reward workers off the generation path, and the client a rollout actor scores with.

    rollout actor (one event loop, shared with every episode in flight)
      group's coroutine: await client.apply(trajs, inputs) ── awaits only its own
           │                                                 episodes' scores; the
           │ pending episodes of every group that finished   engine goes on
           │ meanwhile, one call of up to MAX_CALL  generating the others
           ▼
    RewardWorker i (Ray actor, async): Combiner.score ─▶ each component, chunked by
           its max_batch, bounded by its timeout_s (asyncrl/rewards/combine.py)

The call goes to the worker with the fewest calls in flight. A worker that dies or a
call that fails scores each of its episodes ``reward.on_error`` with the error
recorded: never a crashed actor. Fast path: when the env's own reward is the only
component (``RewardSettings.inline``) the client scores in-process, no Ray hop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from asyncrl.rewards import groupstats
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.combine import Combiner, Scored, build_components
from asyncrl.rewards.settings import RewardSettings

# Episodes per worker call: bounds one call's message size; components chunk further
# by their own max_batch on the worker.
MAX_CALL = 256
# The worker bounds each component's call by its own timeout_s; this only bounds a
# worker that is stuck or gone (its episodes then score on_error).
CALL_TIMEOUT_S = 600.0


class RewardWorker:
    """A Ray actor holding built components (``start_workers``)."""

    def __init__(self, settings: RewardSettings):
        self.combiner = Combiner(build_components(settings.specs()), settings.on_error)

    async def score(self, inputs: list[RewardInput]) -> list[Scored]:
        return await self.combiner.score(inputs)

    def timeout_s(self) -> float:
        return max(r.timeout_s for r, _ in self.combiner.components)

    async def close(self) -> None:
        await self.combiner.close()


def launch_workers(settings: RewardSettings) -> tuple[list[Any], list[Any]]:
    """``reward.workers`` RewardWorker actors (none on the fast path), being built, and
    one ref per worker that resolves once it is built (a bad component raises there):
    a run builds its judge's engine and its reward model while its own engines start.
    They reserve no CPU: they mostly wait (on a judge, a reward model, a sandbox), and
    a CPU reserved here is one a vLLM actor cannot have."""
    import ray

    if settings.inline:
        return [], []
    cls = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=1000)
    workers = [cls.remote(settings) for _ in range(settings.workers)]
    return workers, [w.timeout_s.remote() for w in workers]


def start_workers(settings: RewardSettings) -> list[Any]:
    """:func:`launch_workers`, returned once every worker is built."""
    import ray

    workers, built = launch_workers(settings)
    ray.get(built)
    return workers


def stop_workers(workers: list[Any]) -> None:
    import ray

    for w in workers:
        try:
            ray.get(w.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001, S110 - a dead worker has nothing to close
            pass
        ray.kill(w, no_restart=True)


class RewardClient:
    """What a rollout actor scores with (picklable: settings and worker handles travel;
    the batching state is built in the actor's process on first use)."""

    def __init__(self, settings: RewardSettings | None = None, workers: list[Any] | None = None):
        self._settings = settings
        self.workers = list(workers or [])
        self._init_local()

    def _init_local(self) -> None:
        self._combiner: Combiner | None = None
        self._pending: list[tuple[list[RewardInput], asyncio.Future]] = []
        self._flush_scheduled = False
        self._calls = [0] * len(self.workers)  # calls in flight per worker
        self.stats = {"calls": 0, "episodes": 0, "seconds": 0.0, "errors": 0}
        # called with +1 when a group's scoring begins and -1 when it ends (the rollout
        # actor: a group being scored no longer needs the engine)
        self.on_scoring: Callable[[int], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self._settings, "workers": self.workers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings, self.workers = state["settings"], state["workers"]
        self._init_local()

    @property
    def settings(self) -> RewardSettings:
        """The run's (``set_rewards``); a client built without any (a rollout actor until
        then, a test) scores with conf/'s, composed on first use."""
        if self._settings is None:
            self._settings = RewardSettings.defaults()
        return self._settings

    @property
    def remote(self) -> bool:
        return bool(self.workers)

    async def score(self, inputs: list[RewardInput]) -> list[Scored]:
        if not inputs:
            return []
        t0 = time.perf_counter()
        if self.on_scoring is not None:
            self.on_scoring(1)
        try:
            out = await self._score(inputs)
        finally:
            if self.on_scoring is not None:
                self.on_scoring(-1)
        self.stats["episodes"] += len(inputs)
        self.stats["errors"] += sum(bool(s.error) for s in out)
        self.stats["seconds"] += time.perf_counter() - t0
        return out

    async def _score(self, inputs: list[RewardInput]) -> list[Scored]:
        if not self.remote:
            if self._combiner is None:
                self._combiner = Combiner(
                    build_components(self.settings.specs()), self.settings.on_error
                )
            return await self._combiner.score(inputs)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((inputs, fut))
        if not self._flush_scheduled:  # every group finishing in this loop turn joins
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        while self._pending:
            batch, n = [], 0
            while self._pending and (not batch or n + len(self._pending[0][0]) <= MAX_CALL):
                item = self._pending.pop(0)
                batch.append(item)
                n += len(item[0])
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[list[RewardInput], asyncio.Future]]) -> None:
        i = min(range(len(self.workers)), key=self._calls.__getitem__)
        inputs = [x for ins, _ in batch for x in ins]
        self._calls[i] += 1
        self.stats["calls"] += 1
        try:
            out = await asyncio.wait_for(self.workers[i].score.remote(inputs), CALL_TIMEOUT_S)
            if len(out) != len(inputs):
                raise ValueError(f"answered {len(out)} scores for {len(inputs)} episodes")
        except Exception as e:  # noqa: BLE001 - a lost worker is a recorded error, not a crash
            err = f"reward worker {i}: {type(e).__name__}: {e}"
            out = [Scored(self.settings.on_error, error=err) for _ in inputs]
        finally:
            self._calls[i] -= 1
        k = 0
        for ins, fut in batch:
            if not fut.done():
                fut.set_result(out[k : k + len(ins)])
            k += len(ins)

    async def apply(self, trajs: list, inputs: list[RewardInput]) -> None:
        """Score ``trajs`` (one group) and write reward, breakdown, error and t_end onto
        them, with the group's hacking statistics in each breakdown."""
        scored = await self.score(inputs)
        mon = self.settings.monitor
        dup = groupstats.dup_frac([x.response_ids for x in inputs], mon.dup_min_tokens,
                                  mon.near_dup)  # fmt: skip
        share = groupstats.dominant_share([s.contributions for s in scored])
        now = time.time()
        for t, s in zip(trajs, scored, strict=True):
            t.reward = s.total
            t.reward_breakdown = {**t.reward_breakdown, **s.breakdown, "dup_frac": dup}
            if share is not None:
                t.reward_breakdown["dominant_share"] = share
            if s.error:
                t.error = f"{t.error}; {s.error}" if t.error else s.error
            t.t_end = now
