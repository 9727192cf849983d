"""``monitor`` in config: the run-health alerts' thresholds (asyncrl/monitor/alerts.py).

Checked once in the driver before Ray starts; a bad value names its key.
conf/monitor/default.yaml holds every value.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config import ConfigError, Settings, setting


@dataclass
class MonitorSettings(Settings):
    KEY = "monitor"

    enabled: bool = setting()
    window: int = setting(">= 1")  # steps of history a baseline (running median, best mean) spans
    warmup_steps: int = setting(">= 1")  # no alert before this many steps: baselines need history
    cooldown_steps: int = setting(">= 0")  # after a warning, the same alert stays quiet this long
    # reward collapse: the last `recent_steps` mean falls below this fraction of the best
    # such mean so far (and the best was above reward_floor: a run that never learned
    # has nothing to collapse from)
    recent_steps: int = setting(">= 1")
    reward_collapse_frac: float = setting("[0, 1]")
    reward_floor: float = setting(">= 0")
    # entropy collapse: actor/entropy below this (nats), or below entropy_frac x its
    # first-window mean
    entropy_min: float = setting(">= 0")
    entropy_frac: float = setting("[0, 1]")
    ess_min: float = setting("[0, 1]")  # is/ess (fraction in (0, 1]; 1 = on-policy)
    # spikes: the value above factor x the running median of the window (and above a floor)
    kl_spike_factor: float = setting("> 1")
    kl_floor: float = setting(">= 0")  # is/mismatch_kl below this never alarms (numerical noise)
    grad_spike_factor: float = setting("> 1")
    # staleness pinned: staleness/mean >= pinned_frac x replay.max_staleness for
    # pinned_steps steps in a row
    pinned_frac: float = setting("[0, 1]")
    pinned_steps: int = setting(">= 1")
    # idle imbalance: one side idle more than idle_high of the time, the other less than
    # idle_low (cumulative fractions: perf/learner_idle_frac, perf/actor_idle_frac)
    idle_high: float = setting("[0, 1]")
    idle_low: float = setting("[0, 1]")
    # response-length explosion: response_length/mean above length_factor x its
    # first-window mean, or response_length/clip_ratio above clip_ratio_max
    length_factor: float = setting("> 1")
    clip_ratio_max: float = setting("[0, 1]")

    def check(self) -> None:
        super().check()
        if self.idle_low >= self.idle_high:
            raise ConfigError(
                f"monitor.idle_low={self.idle_low} must be below monitor.idle_high={self.idle_high}"
            )
