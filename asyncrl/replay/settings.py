"""``replay.*`` in config: the queue's staleness bound, policy and capacity. Checked in
the driver before Ray starts (``ReplaySettings.from_config``); the YAML
(``conf/replay/*.yaml``) holds every default."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, settings_from


class ReplayPolicy(enum.StrEnum):
    THROTTLE = "throttle"  # hold actors back before they make samples that would go stale
    DROP = "drop"  # actors run free; stale samples are dropped and counted


@dataclass
class ReplaySettings:
    max_staleness: int
    policy: ReplayPolicy
    max_reuse: int
    capacity_groups: int
    delay_versions: int
    wait_timeout_s: float

    @classmethod
    def from_config(cls, node: Any) -> ReplaySettings:
        return settings_from(cls, node, "replay")

    def check(self) -> None:
        for key in ("max_staleness", "capacity_groups", "delay_versions"):
            if getattr(self, key) < 0:
                raise ConfigError(f"replay.{key}={getattr(self, key)}: must be >= 0")
        if self.max_reuse < 1:
            raise ConfigError(f"replay.max_reuse={self.max_reuse}: must be >= 1")
        if self.wait_timeout_s <= 0:
            raise ConfigError(f"replay.wait_timeout_s={self.wait_timeout_s}: must be > 0")
        if self.delay_versions > self.max_staleness:
            raise ConfigError(
                f"replay.delay_versions={self.delay_versions} exceeds "
                f"replay.max_staleness={self.max_staleness}: every sample would be dropped"
            )

    def buffer_kwargs(self, batch_groups: int) -> dict[str, Any]:
        """The ReplayBuffer's arguments (the queue actor builds its buffer from them)."""
        return {
            "max_staleness": self.max_staleness,
            "batch_groups": batch_groups,
            "policy": self.policy,
            "max_reuse": self.max_reuse,
            "capacity_groups": self.capacity_groups,
            "delay_versions": self.delay_versions,
        }
