"""The actor's settings (``actor.*`` in config), typed and checked once, in the driver
before Ray starts: :meth:`ActorSettings.from_config` names the key of any value it
refuses (``actor.<key>``, ``actor.sampling.<key>``, ``actor.engine.<key>``).

Pure Python (no torch, no vLLM, no Ray): cheap to import anywhere.

Defaults: conf/actor/default.yaml holds every value (``ActorSettings.defaults()``
builds them as ``asyncrl-train`` does); the fields here have none.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, Settings, setting
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.utils.affinity import parse_cpu_list


class UpdateMode(enum.StrEnum):
    """What a weight update does to the requests in flight (actor/weights.py)."""

    ABORT = "abort"  # drop them (their groups are generated again) and clear the KV cache
    WAIT = "wait"  # let them finish on the old weights first, then clear the KV cache
    KEEP = "keep"  # freeze them with their KV and continue them on the new weights


@dataclass
class ActorSettings(Settings):
    """``actor``: how many rollout actors, and how each one generates."""

    KEY = "actor"

    num_actors: int = setting(">= 1")
    num_cpus: float = setting(">= 0")  # Ray CPUs reserved per actor
    num_gpus: float = setting(">= 0")  # Ray GPUs per actor (1 on a GPU cluster: its engine's own)
    max_inflight_groups: int = setting(">= 1")  # prompts generating at once in one engine
    handoff_linger_ms: float = setting("[0, 60000]")  # finished groups wait this long to travel
    # CPU list ("0", "0-3", "0,2", or a YAML list of CPUs) of the engine; None: the OS's
    engine_cores: str | int | list | None = setting()
    update_mode: UpdateMode = setting()
    # a MoE model's engine records the experts its routers chose for every position
    # (Trajectory.routed_experts); None: exactly when learner.moe.routing_replay is on
    record_experts: bool | None = setting()
    sampling: SamplingSettings = setting()
    engine: EngineSettings = setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine_cores = _cpu_list("actor.engine_cores", self.engine_cores)
        try:
            self.update_mode = UpdateMode(self.update_mode)
        except ValueError:
            raise ConfigError(
                f"actor.update_mode={self.update_mode!r}: expected one of "
                f"{', '.join(m.value for m in UpdateMode)}"
            ) from None

    def recording(self, routing_replay: bool) -> ActorSettings:
        """These settings with ``record_experts`` decided (None follows
        ``learner.moe.routing_replay``) and checked against the engine's and the
        learner's."""
        record = routing_replay if self.record_experts is None else self.record_experts
        if routing_replay and not record:
            raise ConfigError(
                "learner.moe.routing_replay=true with actor.record_experts=false: the engine "
                "records no routes to replay; set actor.record_experts=true (or null)"
            )
        if record and self.engine.enable_prefix_caching:
            raise ConfigError(
                "actor.record_experts on with actor.engine.enable_prefix_caching=true: a "
                "prompt read from the prefix cache is never routed, so it has no record; "
                "set actor.engine.enable_prefix_caching=false"
            )
        return dataclasses.replace(self, record_experts=record)

    @property
    def handoff_linger_s(self) -> float:
        return self.handoff_linger_ms / 1000


def _cpu_list(key: str, value: Any) -> str | None:
    """A CPU list as one string ("0", "0-3", "0,2"), from a string, an integer or a
    (YAML) list of them; None stays None."""
    if value is None:
        return None
    try:
        if isinstance(value, bool | float):
            raise ValueError("not a CPU list")
        spec = value if isinstance(value, str | int) else ",".join(str(x) for x in value)
        parse_cpu_list(spec)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: not a CPU list (e.g. '0', '0-3', '0,2')") from None
    return str(spec)
