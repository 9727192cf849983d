"""``replay.*`` in config: the queue's staleness bound, policy and capacity. Checked in
the driver before Ray starts (``ReplaySettings.from_config``); the YAML
(``conf/replay/*.yaml``) holds every default."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from asyncrl.config import TIMEOUT_S, ConfigError, Settings, setting

AUTO = "auto"  # replay.max_staleness=auto: the bound steers itself (replay/steer.py)


class ReplayPolicy(enum.StrEnum):
    THROTTLE = "throttle"  # hold actors back before they make samples that would go stale
    DROP = "drop"  # actors run free; stale samples are dropped and counted


@dataclass
class ReplaySettings(Settings):
    KEY = "replay"

    max_staleness: int | str = setting(">= 0")  # or "auto"
    policy: ReplayPolicy = setting()
    max_reuse: int = setting(">= 1")
    capacity_groups: int = setting(">= 0")
    delay_versions: int = setting(">= 0")
    wait_timeout_s: float = setting(TIMEOUT_S)
    auto_floor: int = setting(">= 0")
    auto_ceiling: int = setting(">= 0")
    auto_ess_widen: float = setting("(0, 1]")
    auto_ess_narrow: float = setting("(0, 1]")
    auto_kl_widen: float = setting("> 0")
    auto_kl_narrow: float = setting("> 0")
    auto_widen_after: int = setting(">= 1")
    auto_narrow_after: int = setting(">= 1")

    def check(self) -> None:
        super().check()
        if isinstance(self.max_staleness, str) and self.max_staleness != AUTO:
            raise ConfigError(
                f"replay.max_staleness={self.max_staleness!r}: expected an integer >= 0 or {AUTO}"
            )
        self._check_auto()
        low = "replay.auto_floor" if self.auto else "replay.max_staleness"
        if self.delay_versions > self.initial_bound:
            raise ConfigError(
                f"replay.delay_versions={self.delay_versions} exceeds "
                f"{low}={self.initial_bound}: every sample would be dropped"
            )

    def _check_auto(self) -> None:
        """The steer's keys: a floor under its ceiling, and two bands per metric."""
        if self.auto_floor > self.auto_ceiling:
            raise ConfigError(
                f"replay.auto_floor={self.auto_floor} exceeds "
                f"replay.auto_ceiling={self.auto_ceiling}"
            )
        hysteresis = "the gap between the two is what keeps the bound from flapping"
        if self.auto_ess_narrow >= self.auto_ess_widen:
            raise ConfigError(
                f"replay.auto_ess_narrow={self.auto_ess_narrow:g} must be below "
                f"replay.auto_ess_widen={self.auto_ess_widen:g}: {hysteresis}"
            )
        if self.auto_kl_narrow <= self.auto_kl_widen:
            raise ConfigError(
                f"replay.auto_kl_narrow={self.auto_kl_narrow:g} must be above "
                f"replay.auto_kl_widen={self.auto_kl_widen:g}: {hysteresis}"
            )

    @property
    def auto(self) -> bool:
        """The bound steers itself (``replay.max_staleness=auto``)."""
        return self.max_staleness == AUTO

    @property
    def initial_bound(self) -> int:
        """The bound the queue starts with: ``auto_floor`` when it steers itself."""
        return self.auto_floor if self.auto else int(self.max_staleness)

    @property
    def highest_bound(self) -> int:
        """The widest the bound can ever be: ``auto_ceiling`` when it steers itself."""
        return self.auto_ceiling if self.auto else int(self.max_staleness)

    def buffer_kwargs(self, batch_groups: int) -> dict[str, Any]:
        """The ReplayBuffer's arguments (the queue actor builds its buffer from them)."""
        return {
            "max_staleness": self.initial_bound,
            "batch_groups": batch_groups,
            "policy": self.policy,
            "max_reuse": self.max_reuse,
            "capacity_groups": self.capacity_groups,
            "delay_versions": self.delay_versions,
        }
