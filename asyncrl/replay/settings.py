"""``replay.*`` in config: the queue's staleness bound, policy and capacity. Checked in
the driver before Ray starts (``ReplaySettings.from_config``); the YAML
(``conf/replay/*.yaml``) holds every default."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from asyncrl.config import TIMEOUT_S, ConfigError, Settings, setting


class ReplayPolicy(enum.StrEnum):
    THROTTLE = "throttle"  # hold actors back before they make samples that would go stale
    DROP = "drop"  # actors run free; stale samples are dropped and counted


@dataclass
class ReplaySettings(Settings):
    KEY = "replay"

    max_staleness: int = setting(">= 0")
    policy: ReplayPolicy = setting()
    max_reuse: int = setting(">= 1")
    capacity_groups: int = setting(">= 0")
    delay_versions: int = setting(">= 0")
    wait_timeout_s: float = setting(TIMEOUT_S)

    def check(self) -> None:
        super().check()
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
