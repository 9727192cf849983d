"""Building the broker from ``broker.*``, and the driver's handle on the WeightBroker.

The driver calls ``publish(version, weights, nbytes=...)``, ``wait()`` and reads
``actor_versions`` / ``dead`` whichever broker runs, so ``train.py`` is the same
for both. The process-group broker is a Ray actor; :class:`BrokerClient` makes
its calls blocking with a deadline and logs the errors it reports.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.broker.objectstore import BrokerError, ObjectStoreBroker
from asyncrl.broker.settings import BrokerSettings, check_broker_config

log = logging.getLogger(__name__)

# On top of the broker's own deadlines: a call that outlives them means the broker
# actor itself hangs (its event loop blocked), which must not hang the driver too.
BACKSTOP_SLACK_S = 600.0


class BrokerClient:
    def __init__(self, handle: Any, settings: BrokerSettings):
        self.handle = handle
        self.settings = settings
        self._errors_seen = 0

    def _get(self, ref: Any) -> Any:
        import ray

        # The broker bounds every step itself; this only catches a broker that hangs.
        s = self.settings
        backstop = s.join_timeout_s + s.pause_timeout_s + 16 * s.timeout_s + BACKSTOP_SLACK_S
        try:
            return ray.get(ref, timeout=backstop)
        except ray.exceptions.GetTimeoutError:
            raise BrokerError(f"the weight broker did not answer within {backstop:.0f}s") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, BrokerError) else BrokerError(str(e))) from None

    def publish(self, version: int, weights: Any = None, nbytes: int = 0) -> dict[str, float]:
        """Snapshot ``version`` from the learner and sync it in the background; returns
        the previous sync's metrics. ``weights`` (an object-store ref) is not needed:
        the broker reads the learner's weights itself."""
        metrics = self._get(self.handle.publish.remote(version, nbytes))
        self._log_new_errors()
        return metrics

    def wait(self) -> dict[str, float]:
        metrics = self._get(self.handle.wait.remote())
        self._log_new_errors()
        return metrics

    def state(self) -> dict[str, Any]:
        return self._get(self.handle.state.remote())

    @property
    def actor_versions(self) -> dict[str, int]:
        return self.state()["actor_versions"]

    @property
    def dead(self) -> dict[str, str]:
        return self.state()["dead"]

    @property
    def errors(self) -> list[str]:
        return self.state()["errors"]

    def set_policy(self, mode: str | None = None, rolling_k: int | None = None) -> None:
        self._get(self.handle.set_policy.remote(mode, rolling_k))

    def learner_digests(self) -> dict[str, str]:
        return self._get(self.handle.learner_digests.remote())

    def close(self) -> None:
        import ray

        try:
            self._get(self.handle.close.remote())
        finally:
            ray.kill(self.handle)

    def _log_new_errors(self) -> None:
        errors = self.state()["errors"]
        for msg in errors[self._errors_seen :]:
            log.error("weight broker: %s", msg)
        self._errors_seen = len(errors)


def learner_ranks(learner: Any) -> list[Any]:
    """Rank actor handles of a learner: a LearnerGroup's ``ranks``, or the one actor."""
    ranks = getattr(learner, "ranks", None)
    return list(ranks) if ranks else [learner]


def start_weight_broker(
    actors: dict[str, Any],
    learner: Any,
    settings: BrokerSettings,
    export: Any = None,
) -> BrokerClient:
    """Start the WeightBroker actor, attach it to learner rank 0 and every actor,
    prime version 0 (``settings.prime``); returns the driver's handle."""
    import ray

    from asyncrl.broker.weight_broker import WeightBroker

    cls = ray.remote(WeightBroker).options(num_cpus=0, max_concurrency=1000)
    handle = cls.remote(actors, learner_ranks(learner), settings, export)
    client = BrokerClient(handle, settings)
    client._get(handle.start.remote())
    return client


def make_broker(
    node: Any, actors: dict[str, Any], learner: Any
) -> ObjectStoreBroker | BrokerClient:
    """The broker ``broker.kind`` names (``node`` is the ``broker`` config)."""
    settings = check_broker_config(node)
    if settings is None:
        return ObjectStoreBroker(actors, timeout_s=node.timeout_s)
    return start_weight_broker(actors, learner, settings)
