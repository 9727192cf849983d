"""The driver's handle on the process-group broker (a Ray actor): its calls made
blocking with a backstop deadline, the errors each call brings back logged here."""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.broker.base import BrokerError
from asyncrl.broker.settings import BrokerSettings

log = logging.getLogger(__name__)

# On top of the broker's own deadlines: a call that outlives them means the broker
# actor itself hangs (its event loop blocked), which must not hang the driver too.
BACKSTOP_SLACK_S = 600.0


class BrokerClient:
    def __init__(self, handle: Any, settings: BrokerSettings):
        self.handle = handle
        self.settings = settings

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

    def _metrics(self, ref: Any) -> dict[str, float]:
        metrics, new_errors = self._get(ref)
        for msg in new_errors:
            log.error("weight broker: %s", msg)
        return metrics

    def start(self) -> BrokerClient:
        """Attach to learner rank 0 and every actor, prime version 0; returns self. Logs
        the weights' path: rank 0 gathers and sends, or each of T learner ranks sends
        its own engine shard (direct)."""
        info = self._get(self.handle.start.remote())
        log.info("weight broker: %s", info["path"])
        return self

    def publish(self, version: int) -> dict[str, float]:
        """Snapshot ``version`` from the learner and sync it in the background; returns
        the previous sync's metrics."""
        return self._metrics(self.handle.publish.remote(version))

    def wait(self) -> dict[str, float]:
        return self._metrics(self.handle.wait.remote())

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

    # ---- actors leaving and joining (asyncrl/fault/actors.py) ----
    def supervise(self) -> None:
        self._get(self.handle.supervise.remote())

    def remove_actor(self, name: str, why: str) -> None:
        self._get(self.handle.remove_actor.remote(name, why))

    def add_actor(self, name: str, handle: Any) -> None:
        """Registered and primed in the background (behind the sync in flight)."""
        self._get(self.handle.add_actor.remote(name, handle))

    def close(self) -> None:
        import ray

        try:
            self._get(self.handle.close.remote())
        finally:
            ray.kill(self.handle)


def spawn_weight_broker(
    settings: BrokerSettings, actors: dict[str, Any], learner_ranks: list[Any]
) -> BrokerClient:
    """The WeightBroker actor's process, started now (it loads while the engines do);
    :meth:`BrokerClient.start` attaches it to learner rank 0 and every actor and
    primes version 0 (``settings.prime``)."""
    import ray

    from asyncrl.broker.weight_broker import WeightBroker

    cls = ray.remote(WeightBroker).options(num_cpus=0, max_concurrency=1000)
    return BrokerClient(cls.remote(actors, list(learner_ranks), settings), settings)


def start_weight_broker(
    settings: BrokerSettings, actors: dict[str, Any], learner_ranks: list[Any]
) -> BrokerClient:
    """:func:`spawn_weight_broker`, started; returns the driver's handle."""
    return spawn_weight_broker(settings, actors, learner_ranks).start()
