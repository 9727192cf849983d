"""``env=code``: write a Python function; hidden test cases grade it in the sandbox,
through the actor's :class:`asyncrl.sandbox.SandboxPool` (``sandbox.workers`` programs
at once, in its threads: the actor's event loop only awaits the grade, and generation
goes on beside it).

    episode ─ await pool.grade(attempt, cases) ─▶ pool thread ─▶ sandboxed process tree
            ◀──────────── Grade (passed/total) ─┘   (at most sandbox.workers at once)

    prompt   # add(a, b): the sum of a and b
    turn 1   def add(a, b): return a - b<eos>      (generated, trained)
    observe  # passed 1/3                          (feedback, never trained)
    turn 2   def add(a, b): return a + b<eos>      (graded again: reward 3/3)

The reward is the last attempt's passed/total. The tiny character-level model does
not learn to program here (its warm start sees a handful of functions); the env is
for real models, and tests/test_envs.py drives it with a scripted policy.
"""

from __future__ import annotations

import asyncio
import random
import string
import threading
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncrl.envs.base import StepResult
from asyncrl.sandbox import Grade, SandboxPool, SandboxSettings
from asyncrl.sandbox.isolation import require
from asyncrl.tasks.base import Prompt, Task

# (name, signature, what it returns, reference body, hidden cases as (args, expected))
PROBLEMS = [
    ("add", "a, b", "the sum of a and b", "a + b", [("1, 2", 3), ("-4, 4", 0), ("10, 5", 15)]),
    ("neg", "x", "minus x", "-x", [("3", -3), ("0", 0), ("-7", 7)]),
    ("double", "x", "two times x", "2 * x", [("2", 4), ("0", 0), ("-5", -10)]),
    ("first", "xs", "the first item of xs", "xs[0]", [("[4, 5]", 4), ("[0]", 0), ("[9, 1, 2]", 9)]),
    ("size", "xs", "the length of xs", "len(xs)", [("[]", 0), ("[1, 2]", 2), ("[3, 3, 3]", 3)]),
    ("big", "a, b", "the larger of a and b", "max(a, b)", [("1, 2", 2), ("5, -1", 5), ("3, 3", 3)]),
]


class CodeTask:
    """One of :data:`PROBLEMS` per prompt; ``meta["cases"]`` are the hidden cases.
    ``sandbox``: the ``sandbox.*`` settings (conf/task/code.yaml passes them all); keys
    left out take conf/'s values. Building the task checks that their isolation is available (ConfigError
    naming ``sandbox.isolation``: the driver exits 2 before Ray starts).

    Grading always goes through this process's :class:`asyncrl.sandbox.SandboxPool`:
    ``await task.areward(prompt, completion)`` from an event loop (the loop only awaits);
    ``reward`` from a thread without one waits for the pool, and on an event loop's own
    thread it raises instead of grading inline (which would stall every episode)."""

    def __init__(self, sandbox: Mapping[str, object] | None = None):
        given = OmegaConf.to_container(sandbox) if isinstance(sandbox, DictConfig) else sandbox
        self.settings = SandboxSettings.defaults(**(given or {}))
        require(self.settings)
        self._pool: SandboxPool | None = None
        self._lock = threading.Lock()

    @property
    def alphabet(self) -> str:
        return string.printable

    def sample(self, rng: random.Random) -> Prompt:
        name, sig, what, body, cases = rng.choice(PROBLEMS)
        return Prompt(
            text=f"# {name}({sig}): {what}\n",
            answer=f"def {name}({sig}): return {body}",
            meta={"cases": [{"call": f"{name}({a})", "expected": e} for a, e in cases]},
        )

    async def areward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        return scores(await self.pool().grade(completion, prompt.meta["cases"]))

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: waiting here stalls nobody
            return scores(self.pool().grade_sync(completion, prompt.meta["cases"]))
        raise RuntimeError(
            "CodeTask.reward on an event loop's thread would stall it for a whole "
            "sandbox run: await CodeTask.areward (env=code does)"
        )

    def pool(self) -> SandboxPool:
        """This task's pool of ``sandbox.workers`` sandboxes (built on first use, in the
        process that grades; never pickled)."""
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.settings)
            return self._pool

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pool=None, _lock=threading.Lock())


def scores(g: Grade) -> dict[str, float]:
    """A :class:`asyncrl.sandbox.Grade` as the task's reward dict."""
    return {"reward": g.reward, "passed": float(g.passed), "sandbox_error": float(bool(g.error))}


_DEFAULT_POOL: SandboxPool | None = None  # an env built without the runner's pool (a test)
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> SandboxPool:
    """One SandboxPool of SandboxSettings' defaults per process, built on first use."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = SandboxPool()
        return _DEFAULT_POOL


class CodeEnv:
    """Grades each attempt; a failing attempt gets ``# passed p/t`` back while attempts
    are left. ``sandbox``: the actor's SandboxPool (the runner passes it; see
    asyncrl/envs/settings.py), or None for this process's default pool. A program that
    breaks a limit or misbehaves is a grade of 0 with its error, never a failed episode."""

    def __init__(self, max_attempts: int = 2, sandbox: SandboxPool | None = None):
        if max_attempts < 1:
            raise ValueError(f"env.max_attempts={max_attempts}: expected >= 1")
        self.max_attempts = max_attempts
        self.sandbox = sandbox
        self.attempts = 0
        self.sample: Prompt | None = None
        self.task: Task | None = None

    async def reset(self, sample: Prompt, task: Task) -> None:
        self.sample, self.task, self.attempts = sample, task, 0

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        self.attempts += 1
        pool = self.sandbox or default_pool()
        out = scores(await pool.grade(text, self.sample.meta["cases"]))
        info = {k: float(v) for k, v in out.items() if k != "reward"}
        if out["reward"] >= 1.0 or self.attempts >= self.max_attempts:
            return StepResult(reward=float(out["reward"]), done=True, tool_calls=1, info=info)
        total = len(self.sample.meta["cases"])
        feedback = f"\n# passed {int(info['passed'])}/{total}\n"
        return StepResult(observation=feedback, tool_calls=1, info=info)
