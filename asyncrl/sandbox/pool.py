"""Grading beside generation: a bounded number of sandboxed executions at once, awaited
from asyncio without blocking the event loop.

    episode tasks ── await pool.grade(...) ──▶ ThreadPoolExecutor(workers threads)
                                                 each thread: one grade_with() call, blocked
                                                 in selectors on its sandbox's pipes
    the event loop only waits on futures; at most ``workers`` sandboxes run at once
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.sandbox.grading import Grade, grade_with
from asyncrl.sandbox.isolation import SandboxUnavailable, detect
from asyncrl.sandbox.settings import SandboxSettings


class SandboxPool:
    """``await pool.grade(solution, cases)`` → Grade. Counters under ``sandbox/`` in
    ``stats()``. Use as a context manager or call ``close()``."""

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        self.settings = settings or SandboxSettings.defaults()
        self.settings.check()
        iso = detect(self.settings.isolation, self.settings.python)  # probe once, up front
        if iso.refusal:
            raise SandboxUnavailable(iso.refusal)
        self.isolation = iso.kind
        self._executor = ThreadPoolExecutor(self.settings.workers, "sandbox")
        self._lock = threading.Lock()
        self._stats = {"execs": 0, "errors": 0, "timeouts": 0, "wall_s": 0.0, "reward": 0.0}

    @classmethod
    def from_config(cls, node: Any) -> SandboxPool:
        return cls(SandboxSettings.from_config(node))

    async def grade(self, solution: str, cases: list[dict]) -> Grade:
        loop = asyncio.get_running_loop()
        g = await loop.run_in_executor(self._executor, self._grade, solution, cases)
        return g

    def grade_sync(self, solution: str, cases: list[dict]) -> Grade:
        """The same from a thread without an event loop (still bounded by ``workers``)."""
        return self._executor.submit(self._grade, solution, cases).result()

    def _grade(self, solution: str, cases: list[dict]) -> Grade:
        g = grade_with(solution, cases, self.settings)
        with self._lock:
            s = self._stats
            s["execs"] += 1
            s["errors"] += bool(g.error)
            s["timeouts"] += "timeout" in g.error
            s["wall_s"] += g.wall_s
            s["reward"] += g.reward
        return g

    def stats(self) -> dict[str, float]:
        with self._lock:
            s = dict(self._stats)
        n = max(s["execs"], 1)
        return {
            "sandbox/execs": s["execs"],
            "sandbox/errors": s["errors"],
            "sandbox/timeouts": s["timeouts"],
            "sandbox/wall_s_mean": s["wall_s"] / n,
            "sandbox/reward_mean": s["reward"] / n,
        }

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)
