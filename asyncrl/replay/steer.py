"""A staleness bound that steers itself (``replay.max_staleness=auto``): pure logic,
no Ray, fed one learner step's metrics at a time.

    loop, after step V ──observe(V, metrics)──▶ StalenessSteer
                                                  │ is/ess, is/mismatch_kl classified:
                                                  │   healthy | hold | degraded
                                                  ▼ streak long enough and room to move
                       queue.set_max_staleness(BoundChange) ◀── the change, with its reason

Additive increase, multiplicative decrease: ``widen_after`` healthy steps in a row widen
the bound by one, ``narrow_after`` degraded steps in a row halve it; every change resets
both streaks, and a step between the two bands (hold) resets them too. The two bands
are the hysteresis: a metric wandering around one threshold moves nothing, and a
widening must be earned again after every change, so the bound cannot flap.

Invariant: ``floor <= bound <= ceiling`` at every moment. The bound itself is enforced
by the queue (:meth:`asyncrl.replay.buffer.ReplayBuffer.set_max_staleness`), never here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from asyncrl.replay.settings import AUTO, ReplaySettings

ESS = "is/ess"  # effective sample size fraction of the batch's IS weights, in (0, 1]
KL = "is/mismatch_kl"  # k3 KL(behaviour || current) over the batch's tokens


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    HOLD = "hold"  # between the bands, or no IS metrics this step
    DEGRADED = "degraded"


@dataclass(frozen=True)
class BoundChange:
    """The queue's staleness bound moves to ``max_staleness`` (sent by the loop to the
    queue actor, ``ReplayQueueCore.set_max_staleness``)."""

    max_staleness: int
    reason: str  # one line: which metric, its value against its band, for how long
    step: int  # the policy version whose step's metrics decided it
    kind: str = "bound_change"


@dataclass(frozen=True)
class Bands:
    """Where a step's ``is/ess`` and ``is/mismatch_kl`` count as healthy or degraded;
    ``ess_narrow < ess_widen`` and ``kl_widen < kl_narrow`` (the hysteresis)."""

    ess_widen: float
    ess_narrow: float
    kl_widen: float
    kl_narrow: float

    def classify(self, metrics: Mapping[str, float]) -> tuple[Health, str]:
        """The step's health and why, in one phrase naming the metric(s)."""
        ess, kl = metrics.get(ESS), metrics.get(KL)
        if ess is None or kl is None:
            return Health.HOLD, f"no {ESS} / {KL} this step"
        if not (math.isfinite(ess) and math.isfinite(kl)):
            return Health.DEGRADED, f"{ESS}={ess} {KL}={kl} (not finite)"
        bad = []
        if ess < self.ess_narrow:
            bad.append(f"{ESS} {ess:.3g} < {self.ess_narrow:g}")
        if kl > self.kl_narrow:
            bad.append(f"{KL} {kl:.3g} > {self.kl_narrow:g}")
        if bad:
            return Health.DEGRADED, " and ".join(bad)
        if ess >= self.ess_widen and kl <= self.kl_widen:
            why = f"{ESS} {ess:.3g} >= {self.ess_widen:g} and {KL} {kl:.3g} <= {self.kl_widen:g}"
            return Health.HEALTHY, why
        return Health.HOLD, f"{ESS} {ess:.3g}, {KL} {kl:.3g} between the bands"


class StalenessSteer:
    """The bound in force and the streaks that move it. ``observe`` once per learner
    step; it answers the :class:`BoundChange` to apply, or None."""

    def __init__(self, floor: int, ceiling: int, bands: Bands, widen_after: int, narrow_after: int):
        if not 0 <= floor <= ceiling:
            raise ValueError(f"need 0 <= floor <= ceiling, got floor={floor} ceiling={ceiling}")
        if widen_after < 1 or narrow_after < 1:
            raise ValueError("widen_after and narrow_after must be >= 1")
        self.floor, self.ceiling, self.bands = floor, ceiling, bands
        self.widen_after, self.narrow_after = widen_after, narrow_after
        self.bound = floor  # starts cautious: widening is earned
        self.changes: list[BoundChange] = []
        self._healthy = 0  # healthy steps in a row
        self._degraded = 0  # degraded steps in a row

    @classmethod
    def from_settings(cls, s: ReplaySettings) -> StalenessSteer | None:
        """The steer of ``replay.max_staleness=auto``; None for a fixed bound."""
        if s.max_staleness != AUTO:
            return None
        bands = Bands(s.auto_ess_widen, s.auto_ess_narrow, s.auto_kl_widen, s.auto_kl_narrow)
        return cls(s.auto_floor, s.auto_ceiling, bands, s.auto_widen_after, s.auto_narrow_after)

    def observe(self, step: int, metrics: Mapping[str, float]) -> BoundChange | None:
        """Step ``step``'s learner metrics in; the change they cause, if any."""
        health, why = self.bands.classify(metrics)
        self._healthy = self._healthy + 1 if health is Health.HEALTHY else 0
        self._degraded = self._degraded + 1 if health is Health.DEGRADED else 0
        if self._healthy >= self.widen_after and self.bound < self.ceiling:
            return self._move(self.bound + 1, step, f"{why} for {self._healthy} steps")
        if self._degraded >= self.narrow_after and self.bound > self.floor:
            new = max(self.floor, self.bound // 2)
            return self._move(new, step, f"{why} for {self._degraded} steps")
        return None

    def _move(self, bound: int, step: int, why: str) -> BoundChange:
        change = BoundChange(bound, f"{self.bound} -> {bound}: {why}", step)
        self.bound = bound
        self.changes.append(change)
        self._healthy = self._degraded = 0
        return change
