"""What the reward model and the judge share: dynamic batching of requests from several
callers, and one named Ray actor per served model that every reward worker finds.

The batcher's loop::

    callers ──submit(items)──▶ pending [(item, future)]
                                  │ wakes on the first item; then waits until
                                  │ max_batch items are pending or max_wait_ms
                                  │ passed since the oldest one arrived
                                  ▼
                     run(up to max_batch items)   (one forward pass / generate call)
                                  │
                     futures resolved in order ──▶ each caller gets its own slice

Requests never wait for each other longer than ``max_wait_ms``; a request bigger than
``max_batch`` is split over several passes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any


class DynamicBatcher:
    """Coalesce ``submit`` calls into calls of ``run`` of at most ``max_batch`` items.

    ``run(items) -> results`` (one per item, in order) is a coroutine function; a
    blocking forward pass goes through ``asyncio.to_thread`` inside it so that the loop
    keeps taking requests while it runs. ``passes`` and ``sizes`` count the calls.
    """

    def __init__(self, run: Callable[[list], Awaitable[list]], max_batch: int, max_wait_ms: float):
        self._run, self.max_batch, self.max_wait_s = run, max_batch, max_wait_ms / 1000
        self._pending: list[tuple[Any, asyncio.Future, float]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.passes, self.sizes = 0, []

    async def submit(self, items: list) -> list:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        loop, now = asyncio.get_running_loop(), time.monotonic()
        futs = [loop.create_future() for _ in items]
        self._pending.extend((it, f, now) for it, f in zip(items, futs))
        self._wake.set()
        return list(await asyncio.gather(*futs))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                deadline = self._pending[0][2] + self.max_wait_s
                while len(self._pending) < self.max_batch and time.monotonic() < deadline:
                    try:
                        await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
                    except TimeoutError:
                        break
                    self._wake.clear()
                take, self._pending = (
                    self._pending[: self.max_batch],
                    self._pending[self.max_batch :],
                )
                await self._flush(take)

    async def _flush(self, take: list) -> None:
        self.passes += 1
        self.sizes.append(len(take))
        try:
            results = await self._run([it for it, _, _ in take])
            if len(results) != len(take):
                raise RuntimeError(f"{len(results)} results for {len(take)} items")
        except Exception as e:  # noqa: BLE001 - every caller of this pass gets the error
            for _, f, _ in take:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f, _), r in zip(take, results):
            if not f.done():
                f.set_result(r)

    def stats(self) -> dict[str, Any]:
        return {"passes": self.passes, "sizes": list(self.sizes)}


def actor_name(kind: str, settings: dict) -> str:
    """One name per (kind, settings): reward workers with the same component share it."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    return f"asyncrl-{kind}-{digest.hexdigest()[:12]}"


def shared_actor(cls: type, name: str, options: dict, *args: Any) -> Any:
    """The named Ray actor ``name``, started from ``cls(*args)`` by the first caller."""
    import ray

    remote = cls if hasattr(cls, "remote") else ray.remote(cls)
    return remote.options(name=name, get_if_exists=True, **options).remote(*args)


def kill_actor(handle: Any) -> None:
    """Stop a served model (every worker's handle to it ends with it)."""
    import ray

    try:
        ray.kill(handle)
    except Exception:  # noqa: BLE001 - already gone (another worker closed it first)
        pass
