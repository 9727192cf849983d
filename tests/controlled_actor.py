"""ControlledRolloutActor: the RolloutActor plus the remote controls that tests and
benchmarks drive it with; training never starts one (``new_actor(..., cls=...)``).
Import it as ``from controlled_actor import ...`` in tests (pytest puts tests/ on
``sys.path``) and as ``from tests.controlled_actor import ...`` in benchmarks; Ray's
workers get the class by value (registered below), so they need not import tests/.

    halt()                 stop the loop, engine kept up: groups generating are
                           cancelled (slots given back), generated ones handed over
    rebind(queue, seed)    while halted: another queue, prompts afresh, counters reset
    resume()               start the loop again
    set_update_mode(m)     abort | wait | keep for the next weight updates
    inject_weight_fault    make the workers die or stall in the next receive
    loaded_digests()       per-tensor digests of what the last receive loaded
    checksums()            per-parameter sha256 of what the engine holds
    worker_params()        each worker's parameters as bytes (ShardProbeExtension)
    episodes_with(env, ps) groups of another env's episodes on this engine, returned

The benchmarks reuse one engine across runs (halt, rebind, resume); the weight-sync
tests check what the engines loaded and how the broker handles failing receivers.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from ray import cloudpickle

from asyncrl.actor import weights
from asyncrl.actor.rollout import ActorStats, RolloutActor
from asyncrl.actor.settings import UpdateMode
from asyncrl.config import ConfigError

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ControlledRolloutActor(RolloutActor):
    async def halt(self) -> None:
        """Stop the generation loop, keeping the engine up."""
        await self._halt()

    async def rebind(self, queue: Any, seed: int) -> None:
        """While halted: generate into ``queue`` from now on, prompts drawn afresh from
        ``seed``, counters and errors reset (the loaded weights and version stay)."""
        if self.slots.running:
            raise RuntimeError("rebind() needs a halted actor: call halt() first")
        self._outbox.close()  # the old queue's take asked ahead fails instead of waiting
        self._bind(queue, seed)
        await self.introduce()
        queue.set_weights_version.remote(self.name, self.version)
        self.stats = ActorStats()
        if self._idle_since is not None:
            self._idle_since = self.stats.started
        self._acquire_calls = 0
        self.fatal = ""

    async def introduce(self) -> None:
        """What start() sends first: the outbox's empty hand-off (the queue's first
        sight of this actor), for an actor given its engine or its queue by a test."""
        await self._outbox.introduce()

    async def resume(self) -> None:
        """Start the generation loop again after :meth:`halt`."""
        if self.engine is None:
            raise RuntimeError("resume() needs a started actor")
        if not self.slots.running:
            self._start_loop()

    def set_update_mode(self, mode: str) -> None:
        try:
            self.update_mode = UpdateMode(mode)
        except ValueError:
            raise ConfigError(
                f"actor.update_mode={mode!r}: expected one of "
                f"{', '.join(m.value for m in UpdateMode)}"
            ) from None

    async def inject_weight_fault(self, kind: str, bucket: int, seconds: float = 0.0) -> list:
        """The workers ``kill`` themselves or ``stall`` at payload ``bucket`` of the
        next receive. Returns the worker pids."""
        args = {"kind": kind, "bucket": bucket, "seconds": seconds}
        return await weights.rpc(self.engine, "asyncrl_inject_fault", args)

    async def loaded_digests(self) -> list[dict[str, Any]]:
        return await weights.rpc(self.engine, "asyncrl_loaded_digests")

    async def checksums(self) -> dict[str, str]:
        return (await weights.rpc(self.engine, "asyncrl_checksums"))[0]

    async def worker_params(self) -> list[dict[str, Any]]:
        return await weights.rpc(self.engine, "asyncrl_params")

    async def episodes_with(self, env: Any, prompts: list) -> list:
        """One group per prompt, run by ``env``'s episode runner (an EnvSettings) on this
        actor's engine and version beside its own loop, returned instead of queued."""
        from asyncrl.actor.env_runner import make_runner

        runner = make_runner(self.engine, self.task, self.settings, env, lambda: self.version)
        return list(await asyncio.gather(*(runner.run_group(p) for p in prompts)))


class _Dropped:
    def remote(self, *args: Any) -> None:
        return None


class NoQueue:
    """The queue handle of an actor whose engine a test drives directly (no generation
    loop): the weight path's ``set_weights_version`` calls are heard and dropped, as a
    queue that is never asked for a slot would."""

    set_weights_version = _Dropped()
