"""``reward`` in config: the components, their weights, the failure policy, the pool
of reward workers and the hacking monitors' thresholds.

Checked once in the driver before Ray starts (``RewardSettings.from_config``): every
component's class is located and its keyword arguments checked against its
constructor, without building it (a judge's constructor may start an engine; the
workers build the components). A bad value names its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncrl.config import (
    ConfigError,
    Settings,
    accepted_kwargs,
    check_finite,
    locate_target,
    setting,
)
from asyncrl.monitor.hacking import HackingSettings

TASK_REWARD = "asyncrl.rewards.task.TaskReward"


@dataclass
class RewardSettings(Settings):
    """``reward``: conf/reward/default.yaml holds every value."""

    KEY = "reward"

    workers: int = setting("[0, 1024]")  # Ray actors scoring episodes off the generation path
    on_error: float = setting()  # the value a failed / timed-out component scores
    components: list = setting()  # {_target_, weight, kwargs}
    monitor: HackingSettings = setting()  # hacking/* monitors

    def check(self) -> None:
        super().check()
        if not self.components:
            raise ConfigError("reward.components is empty: list at least one component")
        names: dict[str, str] = {}
        for i, spec in enumerate(self.components):
            name = _check_component(f"reward.components[{i}]", spec)
            if name in names:
                raise ConfigError(
                    f"reward.components[{i}]: name {name!r} is taken by {names[name]}; "
                    "give one of them name=... (metrics are reward/<name>)"
                )
            names[name] = f"reward.components[{i}]"

    @property
    def inline(self) -> bool:
        """Only the env's own reward: score in-process on the rollout actor, no Ray hop
        (the fast path; a Ray call costs about a millisecond of CPU per side)."""
        return self.workers == 0 or all(
            s["_target_"] == TASK_REWARD and len(s) == 2 for s in self.components
        )

    def specs(self) -> list[tuple[dict[str, Any], float]]:
        """(constructor spec with ``_target_``, weight) per component."""
        return [
            ({k: v for k, v in s.items() if k != "weight"}, float(s["weight"]))
            for s in self.components
        ]


def _check_component(key: str, spec: Any) -> str:
    """The component's metric name, or a ConfigError naming ``key``."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}={spec!r}: expected a mapping with _target_ and weight")
    if not spec.get("_target_"):
        raise ConfigError(f"{key}._target_ is missing: set it to a class like {TASK_REWARD}")
    w = spec.get("weight")
    if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
        raise ConfigError(f"{key}.weight={w!r}: expected a finite number (total = sum w x value)")
    check_finite(key, spec)
    from asyncrl.rewards.base import Reward

    cls = locate_target(key, spec["_target_"])
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise ConfigError(
            f"{key}._target_={spec['_target_']}: not a subclass of asyncrl.rewards.base.Reward"
        )
    accepted = accepted_kwargs(cls)
    given = [k for k in spec if k not in ("_target_", "weight")]
    unknown = [k for k in given if accepted is not None and k not in accepted]
    if unknown:
        raise ConfigError(
            f"{key}: {spec['_target_']} takes no argument(s) {unknown}; "
            f"it accepts {sorted(accepted or [])}"
        )
    check = getattr(cls, "check_config", None)  # its own cheap start-up check (a model dir)
    if check is not None:
        try:
            check({k: spec[k] for k in given})
        except ConfigError as e:
            raise ConfigError(f"{key}.{e}") from e
    return str(spec.get("name", cls.name))
