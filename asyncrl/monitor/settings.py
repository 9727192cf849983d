"""``monitor`` in config: the run-health alerts' thresholds (asyncrl/monitor/alerts.py).

Checked once in the driver before Ray starts; a bad value names its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError


@dataclass
class MonitorSettings:
    enabled: bool = True
    window: int = 20  # steps of history a baseline (running median, best mean) spans
    warmup_steps: int = 10  # no alert before this many steps: the baselines need history
    cooldown_steps: int = 25  # after a warning, the same alert stays quiet this many steps
    # reward collapse: the last `recent_steps` mean falls below this fraction of the best
    # such mean so far (and the best was above reward_floor: a run that never learned
    # has nothing to collapse from)
    recent_steps: int = 5
    reward_collapse_frac: float = 0.5
    reward_floor: float = 0.05
    # entropy collapse: actor/entropy below this (nats), or below entropy_frac x its
    # first-window mean
    entropy_min: float = 0.01
    entropy_frac: float = 0.1
    ess_min: float = 0.5  # is/ess (fraction in (0, 1]; 1 = on-policy)
    # spikes: the value above factor x the running median of the window (and above a floor)
    kl_spike_factor: float = 10.0
    kl_floor: float = 1.0e-3  # is/mismatch_kl below this never alarms (numerical noise)
    grad_spike_factor: float = 10.0
    # staleness pinned: staleness/mean >= pinned_frac x replay.max_staleness for
    # pinned_steps steps in a row
    pinned_frac: float = 0.9
    pinned_steps: int = 10
    # idle imbalance: one side idle more than idle_high of the time, the other less than
    # idle_low (cumulative fractions: perf/learner_idle_frac, perf/actor_idle_frac)
    idle_high: float = 0.6
    idle_low: float = 0.2
    # response-length explosion: response_length/mean above length_factor x its
    # first-window mean, or response_length/clip_ratio above clip_ratio_max
    length_factor: float = 2.0
    clip_ratio_max: float = 0.5

    def check(self) -> None:
        for key in ("window", "warmup_steps", "recent_steps", "pinned_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"monitor.{key}={getattr(self, key)}: must be >= 1")
        if self.cooldown_steps < 0:
            raise ConfigError(f"monitor.cooldown_steps={self.cooldown_steps}: must be >= 0")
        for key in ("reward_collapse_frac", "entropy_frac", "ess_min", "pinned_frac",
                    "idle_high", "idle_low", "clip_ratio_max"):  # fmt: skip
            v = getattr(self, key)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"monitor.{key}={v}: must be in [0, 1]")
        for key in ("kl_spike_factor", "grad_spike_factor", "length_factor"):
            if not getattr(self, key) > 1.0:
                raise ConfigError(f"monitor.{key}={getattr(self, key)}: must be > 1")
        for key in ("entropy_min", "kl_floor", "reward_floor"):
            if getattr(self, key) < 0:
                raise ConfigError(f"monitor.{key}={getattr(self, key)}: must be >= 0")
        if self.idle_low >= self.idle_high:
            raise ConfigError(
                f"monitor.idle_low={self.idle_low} must be below monitor.idle_high={self.idle_high}"
            )

    @classmethod
    def from_config(cls, node: Any) -> MonitorSettings:
        from asyncrl.config import settings_from

        return cls() if node is None else settings_from(cls, node, "monitor")
