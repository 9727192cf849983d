"""Weight brokers: the learner's weights to the actors (see base.py for the seam)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.broker.base import Broker, BrokerError
from asyncrl.broker.settings import BrokerKind, BrokerSettings

__all__ = ["Broker", "BrokerError", "BrokerKind", "BrokerSettings", "make_broker", "spawn_broker"]

Starter = Callable[[], Broker]  # attaches a spawned broker to its parties, primes it


def _objectstore(settings: BrokerSettings, actors: dict[str, Any], ranks: list[Any]) -> Starter:
    from asyncrl.broker.objectstore import ObjectStoreBroker

    return lambda: ObjectStoreBroker(actors, ranks, timeout_s=settings.timeout_s)


def _process_group(settings: BrokerSettings, actors: dict[str, Any], ranks: list[Any]) -> Starter:
    from asyncrl.broker.client import spawn_weight_broker

    client = spawn_weight_broker(settings, actors, ranks)
    return client.start


STARTERS = {BrokerKind.OBJECTSTORE: _objectstore, BrokerKind.GLOO: _process_group}


def spawn_broker(settings: BrokerSettings, actors: dict[str, Any], learner: Any) -> Starter:
    """The broker ``settings.kind`` names for ``actors`` (name -> actor handle) and
    ``learner`` (a LearnerGroup, or anything with ``ranks``: its rank actors): its
    process starts now, while the actors' engines may still be loading; calling what
    this returns, once they are up, attaches it and primes the actors (version 0)."""
    return STARTERS[BrokerKind(settings.kind)](settings, actors, list(learner.ranks))


def make_broker(settings: BrokerSettings, actors: dict[str, Any], learner: Any) -> Broker:
    """:func:`spawn_broker`, started at once."""
    return spawn_broker(settings, actors, learner)()
