"""Run-health alerts from synthetic metric streams: each alert fires on its own failure
(at the right step, with one warning line naming the series and a cause), a healthy
stream raises none, and bad thresholds name their key."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import composed, refused_before_ray

from asyncrl.config import ConfigError
from asyncrl.monitor import HealthMonitor, MonitorSettings

BOUND = 4  # replay.max_staleness of the synthetic run
BREAK = 60  # the step where a failure starts
STEPS = 100


def healthy(step: int, rng: np.random.Generator) -> dict[str, float]:
    """A run that learns: reward up, entropy slowly down, everything else steady."""
    n = lambda s: float(rng.normal(0, s))  # noqa: E731 - a tiny local helper
    return {
        "reward/mean": min(0.9, 0.3 + 0.004 * step) + n(0.03),
        "actor/entropy": 1.2 * (1 - 0.003 * step) + n(0.02),
        "is/ess": 0.93 + n(0.02),
        "is/mismatch_kl": abs(2e-4 + n(5e-5)),
        "learner/grad_norm": abs(0.8 + n(0.15)),
        "staleness/mean": 1.5 + n(0.3),
        "perf/learner_idle_frac": 0.35 + n(0.02),
        "perf/actor_idle_frac": 0.3 + n(0.02),
        "response_length/mean": 6.0 + n(0.3),
        "response_length/clip_ratio": abs(0.02 + n(0.01)),
        "staleness/hist": [0, 1, 2, 2],  # a list: ignored by the rules
    }


BREAKS = {
    "reward_collapse": {"reward/mean": 0.05},
    "entropy_collapse": {"actor/entropy": 0.02},
    "ess_drop": {"is/ess": 0.2},
    "mismatch_kl_spike": {"is/mismatch_kl": 0.05},
    "grad_norm_spike": {"learner/grad_norm": 40.0},
    "staleness_pinned": {"staleness/mean": 3.9},
    "idle_imbalance": {"perf/learner_idle_frac": 0.85, "perf/actor_idle_frac": 0.05},
    "response_length_explosion": {"response_length/mean": 20.0},
}
# steps a failure takes to show: the reward's recent mean and the pinned run need history
DELAY = {"reward_collapse": 2, "staleness_pinned": MonitorSettings.defaults().pinned_steps - 1}


def run(breaks: dict[str, float] | None, seed: int = 0) -> tuple[HealthMonitor, list[dict]]:
    rng = np.random.default_rng(seed)
    mon = HealthMonitor(MonitorSettings.defaults(), max_staleness=BOUND)
    out = []
    for step in range(1, STEPS + 1):
        m = healthy(step, rng)
        if breaks and step >= BREAK:
            m.update(breaks)
        out.append(mon.check(step, m))
    return mon, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_stream_raises_none(seed):
    mon, out = run(None, seed)
    assert mon.warnings == []
    assert all(a["alerts/firing"] == 0 for a in out)
    assert set(out[0]) == {f"alerts/{k}" for k in BREAKS} | {"alerts/firing"}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_alert_fires_on_its_failure(name, caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.monitor"):
        mon, out = run(BREAKS[name])
    first = BREAK + DELAY.get(name, 0)
    series = [a[f"alerts/{name}"] for a in out]
    assert series[: first - 1] == [0.0] * (first - 1), name  # nothing before the failure
    assert series[first - 1] == 1.0, (name, series[BREAK - 5 :])
    others = {
        k for a in out for k, v in a.items() if v and k not in (f"alerts/{name}", "alerts/firing")
    }
    assert others == set(), others
    # one warning line (the cooldown holds the rest back): the step, the series, a cause
    mine = [w for w in mon.warnings if w.startswith(f"alert {name} ")]
    at = [int(w.split(" at step ")[1].split(":")[0]) for w in mine]
    assert at[0] == first and all(
        b - a >= MonitorSettings.defaults().cooldown_steps for a, b in zip(at, at[1:])
    )
    line = mine[0]
    assert f"at step {first}:" in line and "likely cause:" in line
    assert any(k in line for k in BREAKS[name]), line
    assert line in caplog.text
    assert mon.summary()[name]["first_step"] == first


def test_warmup_and_missing_series_stay_quiet():
    mon = HealthMonitor(MonitorSettings.defaults(warmup_steps=5), max_staleness=BOUND)
    for step in range(1, 6):  # inside the warm-up: a broken value does not alarm yet
        assert mon.check(step, {"is/ess": 0.01})["alerts/ess_drop"] == 0
    assert mon.check(6, {"is/ess": 0.01})["alerts/ess_drop"] == 1
    assert mon.check(7, {})["alerts/firing"] == 0  # no series, no verdict
    assert HealthMonitor(MonitorSettings.defaults(enabled=False)).check(1, {"is/ess": 0.0}) == {}


def test_staleness_pinned_follows_the_bound_in_force():
    """Under replay.max_staleness=auto the monitor is built with the ceiling; the step's
    replay/bound (where auto steered it) is what samples pile up at, and the alert
    names it."""
    s = MonitorSettings.defaults(warmup_steps=1, pinned_steps=2)
    mon = HealthMonitor(s, max_staleness=8)  # auto's ceiling
    at_two = {"staleness/mean": 1.95, "replay/bound": 2}
    fired = [mon.check(step, at_two)["alerts/staleness_pinned"] for step in range(1, 5)]
    assert fired[-1] == 1
    (line,) = [w for w in mon.warnings if "staleness_pinned" in w]
    assert "x replay/bound=2 for" in line
    # without replay/bound the configured bound rules: 1.95 is far from 8
    quiet = HealthMonitor(s, max_staleness=8)
    assert all(quiet.check(step, {"staleness/mean": 1.95})["alerts/staleness_pinned"] == 0
               for step in range(1, 6))  # fmt: skip


def test_staleness_pinned_needs_a_bound():
    mon = HealthMonitor(MonitorSettings.defaults(warmup_steps=1, pinned_steps=2), max_staleness=0)
    assert all(mon.check(s, {"staleness/mean": 0.0})["alerts/staleness_pinned"] == 0
               for s in range(1, 20))  # fmt: skip


@pytest.mark.parametrize(
    "node,match",
    [
        ({"window": 0}, "monitor.window=0"),
        ({"ess_min": 1.5}, "monitor.ess_min=1.5"),
        ({"kl_spike_factor": 0.5}, "monitor.kl_spike_factor=0.5"),
        ({"idle_low": 0.7}, "monitor.idle_low=0.7"),
        ({"ess_minimum": 0.5}, r"monitor: unknown key\(s\) \['ess_minimum'\]"),
        ({"enabled": "yes"}, "monitor.enabled='yes'"),
    ],
)
def test_bad_thresholds_name_the_key(node, match):
    with pytest.raises(ConfigError, match=match):
        MonitorSettings.defaults(**node)


@pytest.mark.parametrize(
    "override,key",
    [("++monitor.ess_min=2", "monitor.ess_min=2"), ("++log.part_every=0", "log.part_every=0")],
)
def test_a_run_with_bad_thresholds_is_refused_before_ray(
    override, key, tmp_path, tiny_model, capsys, monkeypatch
):
    """What the CLI runs after composing (exit 2, one line, before Ray and before anything
    is written); tests/test_startup_checks.py holds the command line's own part."""
    line = refused_before_ray(composed(override, "progress=false"), tmp_path, capsys, monkeypatch)
    assert key in line, line
