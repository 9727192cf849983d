"""benchmarks/simulate.py's event loop keeps the runtime's invariants: every episode
finished is trained, dropped as stale or still queued; nothing staler than the bound in
force is trained; the synchronous loop with nothing but generation costs exactly its
generation; more engines never lower throughput while the learner keeps up; and
``--validate`` prints its JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.simulate import (  # noqa: E402
    AUTO,
    AsyncSetup,
    AsyncSim,
    Lognormal,
    SyncSetup,
    Workload,
    async_figures,
    makespan,
    sync_figures,
)

TOOL = Workload(
    batch_groups=4, group_size=4, prompt_tokens=8, turn_tokens=Lognormal(10, 40, 60),
    calls_mean=1.0, max_calls=2, obs_tokens=4, env_s=Lognormal(0.3, 2.0),
    reward_s=Lognormal(0.05, 0.5),
)  # fmt: skip
SETUP = AsyncSetup(
    engines=2, cap=8, step0=0.01, step1=0.001, trainers=1, train_fixed_s=0.05,
    train_token_s=2e-4, publish_s=0.02, sync_fixed_s=0.05, sync_bytes=1e6, sync_gbps=1.0,
    handoff_s=0.01,
)  # fmt: skip


def run(steps: int = 30, **kw) -> AsyncSim:
    return AsyncSim(TOOL, dataclasses.replace(SETUP, **kw), steps, seed=3).run()


@pytest.mark.parametrize(
    "kw",
    [
        {"update_mode": "keep"},
        {"update_mode": "abort"},
        {"update_mode": "wait"},
        {"policy": "drop", "bound": 1},
        {"bound": AUTO, "auto_widen_after": 3},
        {"bound": 0, "update_mode": "abort"},
    ],
)
def test_every_episode_is_trained_dropped_or_queued_and_none_too_stale(kw):
    sim = run(**kw)
    c = sim.counts
    assert len(sim.step_done) == 30
    assert c["produced"] == c["trained"] + c["dropped"] + sim.in_queue()
    assert c["trained"] == 30 * TOOL.batch_groups * TOOL.group_size or c["dropped"] > 0
    staleness, bounds = np.asarray(sim.staleness), np.asarray(sim.bounds_trained)
    assert staleness.size == c["trained"]
    assert (staleness >= 0).all() and (staleness <= bounds).all()
    if kw == {"update_mode": "abort"}:
        assert c["aborted"] > 0 and sim.tokens_wasted > 0
    if kw.get("bound") == 0:  # the throttle holds every start until the weights are new
        assert c["aborted"] == 0 and staleness.max() == 0


def test_drop_policy_drops_what_throttle_holds_back():
    """Running free with a tight bound trains only fresh samples and drops the rest."""
    free = run(steps=12, policy="drop", bound=0, capacity_groups=64)
    held = run(steps=12, policy="throttle", bound=0)
    assert free.counts["dropped"] > held.counts["dropped"]
    assert max(free.staleness) == 0 and max(held.staleness) == 0


def test_sync_loop_with_nothing_but_generation_costs_its_generation():
    w = Workload(batch_groups=3, group_size=4, prompt_tokens=5, turn_tokens=Lognormal(17, 17))
    for padded in (True, False):
        s = SyncSetup(engines=2, cap=4, step0=0.02, step1=0.003, padded=padded, trainers=1,
                      train_fixed_s=0.0, train_token_s=0.0)  # fmt: skip
        f = sync_figures(w, s, steps=3)
        # 12 answers of 17 tokens, 6 per engine, at most 4 decoding at once: 4 then 2
        expected = 17 * (0.02 + 0.003 * 4) + 17 * (0.02 + 0.003 * 2)
        assert f["seconds_per_step"] == pytest.approx(expected)
        assert f["generate_seconds"] == pytest.approx(f["seconds_per_step"])
        assert f["share_generate"] == pytest.approx(1.0)


def test_makespan_of_unequal_answers_frees_rows_unless_padded():
    lengths = [1, 2, 10]
    assert makespan(lengths, 8, 1.0, 0.5, padded=True) == pytest.approx(10 * 2.5)
    # all three for 1 token, two for 1 more, one for 8 more
    assert makespan(lengths, 8, 1.0, 0.5, padded=False) == pytest.approx(2.5 + 2.0 + 8 * 1.5)


def test_more_engines_never_lower_throughput_while_the_learner_keeps_up():
    fast_learner = dict(train_fixed_s=0.001, train_token_s=0.0, publish_s=0.0)
    rates = []
    for engines in (1, 2, 4, 8):
        sim = run(steps=20, engines=engines, bound=4, **fast_learner)
        rates.append(async_figures(sim, warmup=3)["samples_per_s"])
    assert all(b >= a * 0.98 for a, b in zip(rates, rates[1:])), rates
    assert rates[-1] > 2 * rates[0]


def test_validate_prints_one_json_line_of_cases():
    r = subprocess.run([sys.executable, "-m", "benchmarks.simulate", "--validate", "--quick"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"calibration", "cases", "max_error_host", "max_error_published"} <= set(out)
    for case in out["cases"]:
        assert {"name", "figure", "predicted", "measured", "error", "goal"} <= set(case)
        assert case["predicted"] > 0 and case["error"] == pytest.approx(
            abs(case["predicted"] - case["measured"]) / case["measured"])  # fmt: skip
