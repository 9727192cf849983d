"""Run-health alerts, from the metrics of each learner step, in the driver.

    loop: step V's metrics ─▶ HealthMonitor.check(V, metrics)
            each rule reads its series and its own history (running median, best
            recent mean, first-window mean) ─▶ fires or not
          ─▶ ``alerts/<name>`` = 1.0 / 0.0 every step, into the same metrics
          ─▶ one warning line when an alert starts firing (then quiet for
             ``monitor.cooldown_steps``): the step, the series, the value, the likely cause

A rule whose series a run does not log (no ``actor/entropy`` from a custom learner, no
``perf/*`` in a benchmark) stays 0. Nothing here blocks or stops the run.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.monitor.hacking import HackingRules, HackingSettings
from asyncrl.monitor.settings import MonitorSettings

log = logging.getLogger("asyncrl.monitor")


@dataclass
class Firing:
    """One rule's verdict on one step: the series it read, its value, what it compared
    against, and the likely cause in words."""

    series: str
    value: float
    against: str
    cause: str


@dataclass
class _History:
    values: dict[str, deque] = field(default_factory=dict)
    first: dict[str, list[float]] = field(default_factory=dict)  # the first window's values
    best_recent: float = -math.inf
    pinned_run: int = 0


class HealthMonitor:
    """``check(step, metrics)`` -> the ``alerts/*`` metrics; warnings go to the log and
    to :attr:`warnings` (the lines, for the summary and tests)."""

    def __init__(
        self,
        settings: MonitorSettings | None = None,
        max_staleness: int = 0,
        hacking: HackingSettings | None = None,  # reward.monitor: the hacking/* rules
    ):
        self.s = settings or MonitorSettings.defaults()
        self.max_staleness = max_staleness
        self.h = _History()
        self.steps = 0
        self.quiet_until: dict[str, int] = {}
        self.warnings: list[str] = []
        self.fired: dict[str, dict[str, int]] = {}  # name -> {"steps", "first_step"}
        self.rules: dict[str, Callable[[dict[str, float]], Firing | None]] = {
            "reward_collapse": self._reward_collapse,
            "entropy_collapse": self._entropy_collapse,
            "ess_drop": self._ess_drop,
            "mismatch_kl_spike": self._kl_spike,
            "grad_norm_spike": self._grad_spike,
            "staleness_pinned": self._staleness_pinned,
            "idle_imbalance": self._idle_imbalance,
            "response_length_explosion": self._length_explosion,
        }
        # the hacking/* rules (asyncrl/monitor/hacking.py), with the reward's settings
        # (train.py passes reward.monitor; None: off, as for a monitor of other streams)
        self.hacking = HackingRules(hacking or HackingSettings.defaults(enabled=False))
        self.rules.update(self.hacking.rules())

    def check(self, step: int, metrics: dict) -> dict[str, float]:
        if not self.s.enabled:
            return {}
        m = {k: float(v) for k, v in metrics.items() if _number(v)}
        self.steps += 1
        out: dict[str, float] = {}
        hacking = self.hacking.observe(m)  # hacking/*: the series its rules read
        for name, rule in self.rules.items():
            f = rule(m) if self.steps > self.s.warmup_steps else None
            out[f"alerts/{name}"] = 1.0 if f else 0.0
            if f:
                self._record(name, step, f)
        out["alerts/firing"] = sum(out.values())
        out.update(hacking)
        self._remember(m)
        return out

    def _record(self, name: str, step: int, f: Firing) -> None:
        rec = self.fired.setdefault(name, {"steps": 0, "first_step": step})
        rec["steps"] += 1
        if step < self.quiet_until.get(name, -1):
            return
        self.quiet_until[name] = step + self.s.cooldown_steps
        # ``step`` is the version the step published, as in TensorBoard; the trajectory
        # log files the batch under the version it trained from, one less
        line = (
            f"alert {name} at step {step}: {f.series}={f.value:.4g} ({f.against}); "
            f"likely cause: {f.cause} [its batch: asyncrl-inspect RUN_DIR --step {step - 1}]"
        )
        self.warnings.append(line)
        log.warning(line)

    # ---- history ---------------------------------------------------------------------
    def _remember(self, m: dict[str, float]) -> None:
        for k, v in m.items():
            if not math.isfinite(v):
                continue
            self.h.values.setdefault(k, deque(maxlen=self.s.window)).append(v)
            first = self.h.first.setdefault(k, [])
            if len(first) < self.s.window:
                first.append(v)
        recent = self._recent_mean("reward/mean")
        if recent is not None:
            self.h.best_recent = max(self.h.best_recent, recent)

    def _median(self, key: str) -> float | None:
        vals = self.h.values.get(key)
        return statistics.median(vals) if vals else None

    def _first_mean(self, key: str) -> float | None:
        vals = self.h.first.get(key)
        return sum(vals) / len(vals) if vals else None

    def _recent_mean(self, key: str, extra: float | None = None) -> float | None:
        vals = list(self.h.values.get(key, ()))[-self.s.recent_steps :]
        if extra is not None:
            vals = (vals + [extra])[-self.s.recent_steps :]
        return sum(vals) / len(vals) if len(vals) >= self.s.recent_steps else None

    # ---- the rules -------------------------------------------------------------------
    def _reward_collapse(self, m: dict[str, float]) -> Firing | None:
        if "reward/mean" not in m or self.h.best_recent < self.s.reward_floor:
            return None
        now = self._recent_mean("reward/mean", m["reward/mean"])
        bar = self.s.reward_collapse_frac * self.h.best_recent
        if now is None or now >= bar:
            return None
        return Firing(
            f"reward/mean (last {self.s.recent_steps} steps)", now,
            f"below {bar:.4g}, {self.s.reward_collapse_frac:g} x the best {self.h.best_recent:.4g}",
            "the policy is unlearning: too high an LR, off-policy drift (check is/mismatch_kl, "
            "staleness) or a reward that broke (check reward/errors)",
        )  # fmt: skip

    def _entropy_collapse(self, m: dict[str, float]) -> Firing | None:
        v, first = m.get("actor/entropy"), self._first_mean("actor/entropy")
        if v is None:
            return None
        bar = max(self.s.entropy_min, self.s.entropy_frac * first if first else 0.0)
        if v >= bar:
            return None
        return Firing(
            "actor/entropy", v, f"below {bar:.4g} (first-window mean {first or 0:.4g})",
            "the policy turned (near) deterministic: exploration is gone; lower the LR, add "
            "an entropy bonus or raise the sampling temperature",
        )  # fmt: skip

    def _ess_drop(self, m: dict[str, float]) -> Firing | None:
        v = m.get("is/ess")
        if v is None or v >= self.s.ess_min:
            return None
        return Firing(
            "is/ess", v, f"below monitor.ess_min={self.s.ess_min:g}",
            "importance weights concentrate on few tokens: samples too stale for the "
            "current policy; lower replay.max_staleness or the LR",
        )  # fmt: skip

    def _spike(self, m: dict, key: str, factor: float, floor: float) -> tuple[float, float] | None:
        v, med = m.get(key), self._median(key)
        if v is None or med is None or v <= floor or v <= factor * max(med, 0.0):
            return None
        return v, med

    def _kl_spike(self, m: dict[str, float]) -> Firing | None:
        got = self._spike(m, "is/mismatch_kl", self.s.kl_spike_factor, self.s.kl_floor)
        if got is None:
            return None
        return Firing(
            "is/mismatch_kl", got[0], f"{got[0] / max(got[1], 1e-30):.3g} x its running median "
            f"{got[1]:.3g}", "actor and learner log-probs disagree: a failed or partial weight "
            "sync, a sampling-setting mismatch (temperature/top-k/top-p), or very stale samples",
        )  # fmt: skip

    def _grad_spike(self, m: dict[str, float]) -> Firing | None:
        got = self._spike(m, "learner/grad_norm", self.s.grad_spike_factor, 0.0)
        if got is None:
            return None
        return Firing(
            "learner/grad_norm", got[0], f"{got[0] / max(got[1], 1e-30):.3g} x its running "
            f"median {got[1]:.3g}", "an outlier batch (huge IS ratios or advantages) or an "
            "unstable LR; inspect this step's trajectories (asyncrl-inspect --step)",
        )  # fmt: skip

    def _staleness_pinned(self, m: dict[str, float]) -> Firing | None:
        # the bound in force this step (replay/bound: what replay.max_staleness=auto
        # steered it to), else the configured one
        v, live = m.get("staleness/mean"), m.get("replay/bound")
        bound = int(live) if live is not None else self.max_staleness
        name = "replay/bound" if live is not None else "replay.max_staleness"
        pinned = v is not None and bound > 0 and v >= self.s.pinned_frac * bound
        self.h.pinned_run = self.h.pinned_run + 1 if pinned else 0
        if self.h.pinned_run < self.s.pinned_steps:
            return None
        return Firing(
            "staleness/mean", v, f">= {self.s.pinned_frac:g} x {name}={bound} for "
            f"{self.h.pinned_run} steps", "the learner trains only on samples at the bound: "
            "it falls behind the actors; add learner ranks or fewer actors / smaller groups",
        )  # fmt: skip

    def _idle_imbalance(self, m: dict[str, float]) -> Firing | None:
        learner, actor = m.get("perf/learner_idle_frac"), m.get("perf/actor_idle_frac")
        if learner is None or actor is None:
            return None
        hi, lo = self.s.idle_high, self.s.idle_low
        if learner > hi and actor < lo:
            return Firing(
                "perf/learner_idle_frac", learner, f"> {hi:g} while perf/actor_idle_frac="
                f"{actor:.3g}", "the learner waits for data: generation is the bottleneck; "
                "add actors or lower actor.sampling.n / learner.batch_groups",
            )  # fmt: skip
        if actor > hi and learner < lo:
            return Firing(
                "perf/actor_idle_frac", actor, f"> {hi:g} while perf/learner_idle_frac="
                f"{learner:.3g}", "the actors wait (backpressure or the staleness window): "
                "training is the bottleneck; add learner ranks or fewer actors",
            )  # fmt: skip
        return None

    def _length_explosion(self, m: dict[str, float]) -> Firing | None:
        clip = m.get("response_length/clip_ratio")
        if clip is not None and clip > self.s.clip_ratio_max:
            return Firing(
                "response_length/clip_ratio", clip, f"> monitor.clip_ratio_max="
                f"{self.s.clip_ratio_max:g}", "most responses hit the token limit: the policy "
                "rambles or loops (a length-hacked reward?); check the responses",
            )  # fmt: skip
        v, first = m.get("response_length/mean"), self._first_mean("response_length/mean")
        if v is None or not first or v <= self.s.length_factor * first:
            return None
        return Firing(
            "response_length/mean", v, f"{v / first:.3g} x its first-window mean {first:.4g}",
            "responses grow fast: a length-rewarding reward or a loss normalisation that "
            "favours long sequences; check the responses",
        )  # fmt: skip

    def summary(self) -> dict[str, dict[str, int]]:
        """``name -> {"steps": steps it fired, "first_step"}`` (the summary's ``alerts``)."""
        return {k: dict(v) for k, v in self.fired.items()}


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
