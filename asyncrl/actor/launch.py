"""Starting a rollout actor as a Ray actor."""

from __future__ import annotations

from typing import Any

from asyncrl.actor.rollout import RolloutActor
from asyncrl.actor.settings import ActorSettings
from asyncrl.envs.settings import EnvSettings
from asyncrl.tasks.base import Task

# Ray calls one actor serves at once. Its methods are coroutines that mostly wait
# (a weight receive waits on its workers for seconds): stats, pings and the broker's
# calls must never queue behind one.
MAX_CONCURRENCY = 1000


def new_actor(
    settings: ActorSettings,
    model_path: str,
    task: Task,
    queue: Any,
    name: str,
    seed: int,
    cls: type[RolloutActor] | None = None,
    env: EnvSettings | None = None,
) -> Any:
    """A :class:`RolloutActor` (or a subclass ``cls``: the tests add controls to it)
    as a Ray actor, ``settings.num_cpus`` CPUs reserved. Not started: the caller calls
    ``start.remote()`` (the engine takes ~25 s to start on a CPU). ``env``: the episodes'
    environment (None: single-turn)."""
    import ray

    return (
        ray.remote(cls or RolloutActor)
        .options(
            num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, max_concurrency=MAX_CONCURRENCY
        )
        .remote(name, model_path, task, queue, settings, seed, env)
    )
