"""Weight brokers: the learner's weights to the actors (see base.py for the seam)."""

from __future__ import annotations

from typing import Any

from asyncrl.broker.base import Broker, BrokerError
from asyncrl.broker.settings import BrokerKind, BrokerSettings

__all__ = ["Broker", "BrokerError", "BrokerKind", "BrokerSettings", "make_broker"]


def _objectstore(settings: BrokerSettings, actors: dict[str, Any], ranks: list[Any]) -> Broker:
    from asyncrl.broker.objectstore import ObjectStoreBroker

    return ObjectStoreBroker(actors, ranks, timeout_s=settings.timeout_s)


def _process_group(settings: BrokerSettings, actors: dict[str, Any], ranks: list[Any]) -> Broker:
    from asyncrl.broker.client import start_weight_broker

    return start_weight_broker(settings, actors, ranks)


STARTERS = {BrokerKind.OBJECTSTORE: _objectstore, BrokerKind.GLOO: _process_group}


def make_broker(settings: BrokerSettings, actors: dict[str, Any], learner: Any) -> Broker:
    """The broker ``settings.kind`` names, started on ``actors`` (name -> actor handle)
    and ``learner`` (a LearnerGroup, or anything with ``ranks``: its rank actors)."""
    return STARTERS[BrokerKind(settings.kind)](settings, actors, list(learner.ranks))
