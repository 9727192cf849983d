"""The running parts of one training run, and what the loop needs of each.

    wiring.start_parts ──builds──▶ Parts(queue, actors, learner, broker,
                                         supervisor, reward_workers, ...)
    loop.run_loop ──uses──▶ queue.get_batch / set_learner_version / stats
                            actors[name].get_stats
                            learner.submit_train_step
                            broker.publish / wait
                            supervisor.poll / hopeless / metrics
    wiring.stop_parts ──closes──▶ every part, the accounting read on the way

The queue, the actors and the reward workers are Ray actor handles: their methods
are called with ``.remote(...)`` and answer an ObjectRef (:class:`RemoteMethod`). The
learner group and the broker are plain objects in the driver that make their Ray
calls themselves. The Protocols name only what the driver's loop, start and stop call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from asyncrl.broker.base import Broker

if TYPE_CHECKING:
    from ray import ObjectRef


class RemoteMethod(Protocol):
    """One method of a Ray actor handle."""

    def remote(self, *args: object) -> ObjectRef: ...


class QueueHandle(Protocol):
    """The replay queue's Ray actor (asyncrl/replay/queue.py)."""

    get_batch: RemoteMethod  # (groups, version, wait_s) -> list of refs + metadata
    set_learner_version: RemoteMethod  # (version) -> None: the staleness window moves
    set_max_staleness: RemoteMethod  # (BoundChange) -> dropped: the bound moves
    stats: RemoteMethod  # () -> accounting dict (produced, trained, dropped_stale, ...)
    close: RemoteMethod  # () -> None: no slot granted any more


class ActorHandle(Protocol):
    """A rollout actor's Ray actor (asyncrl/actor/rollout.py)."""

    start: RemoteMethod  # () -> None once its engine is up
    stop: RemoteMethod  # () -> its final stats
    get_stats: RemoteMethod  # () -> stats dict (tokens, idle_seconds, placement, ...)
    set_rewards: RemoteMethod  # (RewardClient) -> None


class LearnerHandle(Protocol):
    """The learner ranks as one object in the driver (asyncrl/learner/group.py)."""

    ranks: list  # the ranks' Ray actor handles ([] once closed)

    def submit_train_step(self, items: list, version: int) -> ObjectRef: ...

    def ping(self) -> bool: ...

    def close(self, timeout_s: float = ...) -> None: ...


class Supervisor(Protocol):
    """The dead-actor supervisor (asyncrl/fault/actors.py)."""

    @property
    def restarting(self) -> bool: ...

    def poll(self, states: dict[str, object] | None = None) -> None: ...

    def hopeless(self) -> str: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class FleetBroker(Broker, Protocol):
    """A broker whose actors can change while it runs (both kinds, asyncrl/broker/)."""

    def supervise(self) -> None: ...

    def remove_actor(self, name: str, why: str) -> None: ...

    def add_actor(self, name: str, handle: ActorHandle) -> None: ...


class RewardWorkerHandle(Protocol):
    """A reward worker's Ray actor (asyncrl/rewards/pool.py)."""

    close: RemoteMethod


@dataclass
class Fleet:
    """What the actor supervisor watches and changes: it replaces a dead actor in
    ``actors`` (the same dict as :attr:`Parts.actors`), has the broker sync it and
    the queue free the dead one's slots."""

    queue: QueueHandle
    actors: dict[str, ActorHandle]
    broker: FleetBroker


@dataclass
class Parts:
    """Every running part of a run, built whole by ``asyncrl.wiring.start_parts``.

    ``actors`` holds the actors that are up or being synced (the supervisor replaces a
    dead one under its name); ``broker`` is None once closed (``stop_parts``) or killed
    (a dead learner rank, asyncrl/fault/learner.py)."""

    queue: QueueHandle
    actors: dict[str, ActorHandle]
    learner: LearnerHandle
    broker: Broker | None
    started_ray: bool  # this run started Ray (and shuts it down)
    supervisor: Supervisor | None = None  # None with fault.actor_restarts=0
    reward_workers: list[RewardWorkerHandle] = field(default_factory=list)  # reward.workers
    # threads moved off actor.engine_cores (wiring.keep_off_engines): tid -> former cores
    moved_affinity: dict[int, set[int]] = field(default_factory=dict)
