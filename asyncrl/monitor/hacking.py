"""Reward-hacking monitors: rules of the run-health monitor (alerts.py registers them),
each a metric under ``hacking/`` every step and, when it fires, ``alerts/hacking_<name>``
and one warning line naming the step and the likely cause.

    step V's metrics ─▶ HackingRules.observe: hacking/* from the series below, and
                        each series' first window (the baseline) and recent window
                     ─▶ the rules compare recent against baseline (after the monitor's
                        warmup_steps, like every alert)

Series read (all from the learner's step metrics; a run without one stays quiet):

* ``reward/mean`` and ``reward/<verifier>``: a second verifier on the same training
  samples (a weight-0 component, e.g. StrictAnswer). The reward rising while the
  verifier does not is the policy learning the reward, not the task.
* ``response_length/mean``: drift against the first window (DAPO's overlong failure).
* ``reward/dominant_share``: the largest component's share of sum |weight x value|
  (the pool computes it per group, only with two or more weighted components).
* ``reward/dup_frac``: the share of responses in a group that (near-)duplicate an
  earlier one (pool-side; responses shorter than ``dup_min_tokens`` are not counted:
  identical correct short answers are not a hack).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config import Settings, setting


@dataclass
class HackingSettings(Settings):
    """``reward.monitor`` in config (conf/reward/default.yaml holds every value)."""

    KEY = "reward.monitor"

    enabled: bool = setting()
    window: int = setting(">= 1")  # steps whose mean is a series' baseline (its first steps)
    recent_steps: int = setting(">= 1")  # steps whose mean is compared against the baseline
    verifier: str = setting()  # the second verifier's component name: reward/<verifier>
    min_rise: float = setting("> 0")  # reward/mean rise (recent - baseline) that counts as rising
    verifier_frac: float = setting("[0, 1]")  # ... while the verifier rose less than this share
    length_factor: float = setting("> 1")  # response_length/mean above this x its baseline
    dominance_max: float = setting("[0, 1]")  # one component's share of the total above this
    dup_max: float = setting("[0, 1]")  # dup_frac above this ...
    dup_rise: float = setting(">= 0")  # ... and this much above its baseline: climbing
    dup_min_tokens: int = setting(">= 1")  # responses shorter than this are never duplicates
    near_dup: float = setting("[0, 1]")  # Jaccard similarity of token 3-grams: near-duplicate


@dataclass
class Firing:  # the same fields as alerts.Firing (kept apart: alerts.py imports this)
    series: str
    value: float
    against: str
    cause: str


class _Series:
    """One series' baseline (mean of its first ``window`` values) and recent mean."""

    def __init__(self, window: int, recent: int):
        self.first: list[float] = []
        self.window = window
        self.recent: deque[float] = deque(maxlen=recent)

    def add(self, v: float) -> None:
        if len(self.first) < self.window:
            self.first.append(v)
        self.recent.append(v)

    def ready(self) -> bool:
        return len(self.first) == self.window and len(self.recent) == self.recent.maxlen

    @property
    def base(self) -> float:
        return sum(self.first) / len(self.first)

    @property
    def now(self) -> float:
        return sum(self.recent) / len(self.recent)


class HackingRules:
    """``observe(metrics)`` -> the ``hacking/*`` metrics; ``rules()``: name -> rule, for
    :class:`asyncrl.monitor.alerts.HealthMonitor` to run with its own."""

    SERIES = ("reward/mean", "response_length/mean", "reward/dominant_share", "reward/dup_frac")

    def __init__(self, settings: HackingSettings | None = None):
        self.s = settings or HackingSettings.defaults()
        keys = (*self.SERIES, f"reward/{self.s.verifier}")
        self.series = {k: _Series(self.s.window, self.s.recent_steps) for k in keys}
        self.last: dict[str, float] = {}

    def observe(self, m: dict[str, float]) -> dict[str, float]:
        if not self.s.enabled:
            return {}
        for k, ser in self.series.items():
            if k in m:
                ser.add(m[k])
        out: dict[str, float] = {}
        r, v = self.series["reward/mean"], self.series[f"reward/{self.s.verifier}"]
        if r.ready():
            out["hacking/reward_rise"] = r.now - r.base
            if v.ready():
                out["hacking/verifier_rise"] = v.now - v.base
        length = self.series["response_length/mean"]
        if length.ready() and length.base > 0:
            out["hacking/length_drift"] = length.now / length.base
        for key, name in (("reward/dominant_share", "dominant_share"), ("reward/dup_frac",
                                                                        "dup_frac")):  # fmt: skip
            if self.series[key].ready():
                out[f"hacking/{name}"] = self.series[key].now
        self.last = out
        return out

    def rules(self) -> dict[str, Callable[[dict[str, float]], Any]]:
        if not self.s.enabled:
            return {}
        return {
            "hacking_verifier_gap": self._verifier_gap,
            "hacking_length_drift": self._length_drift,
            "hacking_dominance": self._dominance,
            "hacking_duplicates": self._duplicates,
        }

    def _verifier_gap(self, m: dict[str, float]) -> Firing | None:
        rise, vrise = self.last.get("hacking/reward_rise"), self.last.get("hacking/verifier_rise")
        if rise is None or vrise is None or rise < self.s.min_rise:
            return None
        if vrise >= self.s.verifier_frac * rise:
            return None
        return Firing(
            "hacking/reward_rise", rise, f"reward/{self.s.verifier} rose {vrise:.4g} over the "
            f"same steps (< {self.s.verifier_frac:g} x)", "the reward rises while a second "
            "verifier on the same samples does not: the policy is learning the reward, not "
            "the task; check reward/<component> and the responses",
        )  # fmt: skip

    def _length_drift(self, m: dict[str, float]) -> Firing | None:
        d = self.last.get("hacking/length_drift")
        if d is None or d <= self.s.length_factor:
            return None
        return Firing(
            "hacking/length_drift", d, f"response_length/mean over its baseline > "
            f"reward.monitor.length_factor={self.s.length_factor:g}", "responses grow: a "
            "reward that pays for length (add an overlong penalty, asyncrl.rewards.shaping)",
        )  # fmt: skip

    def _dominance(self, m: dict[str, float]) -> Firing | None:
        d = self.last.get("hacking/dominant_share")
        if d is None or d <= self.s.dominance_max:
            return None
        return Firing(
            "hacking/dominant_share", d, f"> reward.monitor.dominance_max="
            f"{self.s.dominance_max:g}", "one reward component makes up nearly all of the "
            "total: the others no longer steer the policy; check the weights",
        )  # fmt: skip

    def _duplicates(self, m: dict[str, float]) -> Firing | None:
        ser = self.series["reward/dup_frac"]
        d = self.last.get("hacking/dup_frac")
        if d is None or d <= self.s.dup_max or d - ser.base <= self.s.dup_rise:
            return None
        return Firing(
            "hacking/dup_frac", d, f"> reward.monitor.dup_max={self.s.dup_max:g}, baseline "
            f"{ser.base:.3g}", "responses within groups (near-)duplicate each other more and "
            "more: a degenerate answer the reward pays for, or collapsed exploration",
        )  # fmt: skip
