"""End to end through the real CLI: vLLM-CPU actor, Ray queue, learner, weights back.

Asserts what the README promises of the default run, on a shorter run (the session's
``default_run``: the strict verifier scored beside at weight 0): reward goes up,
versions advance, no trained sample is staler than the bound, and every trajectory is
accounted for.
"""

from __future__ import annotations

import json

import pytest
from helpers import DEFAULT_RUN_STEPS, WITH_STRICT_AT_0, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def short_run(default_run):
    assert DEFAULT_RUN_STEPS == 120  # the figures below
    return default_run


def test_summary_properties(short_run):
    s = json.loads((short_run / "summary.json").read_text())
    assert s["steps"] == 120 and s["policy_version"] == 120
    assert s["reward_mean_last"] > s["reward_mean_first"], s
    assert s["max_staleness_trained"] <= s["max_staleness_bound"]
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    # batch_groups x n per step, less the few stale members dropped from a group
    assert s["trajectories_trained"] >= 0.95 * 120 * 16 * 8
    assert s["tokens_generated"] >= s["tokens_trained"] > 0
    # where the start-up went, in the order the driver passed each point
    phases = s["startup_phases"]
    order = ["imports", "prepared", "ray_up", "learner_started", "engines_up", "learner_up",
             "broker_up", "first_step"]  # fmt: skip
    assert list(phases) == order and sorted(phases.values()) == list(phases.values()), phases
    assert phases["first_step"] == s["startup_seconds"]


def test_outputs_written(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.utils.runlog import read_trajectories

    assert (short_run / "config.yaml").read_text().count("max_steps: 120") == 1
    t = read_trajectories(short_run)
    s = json.loads((short_run / "summary.json").read_text())
    assert t.num_rows == s["trajectories_trained"]
    assert max(t.column("staleness").to_pylist()) <= s["max_staleness_bound"]
    ea = EventAccumulator(str(short_run / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    # the loop logs each step while the learner trains the next: every step once, in order
    assert [e.step for e in ea.Scalars("reward/mean")] == list(range(1, 121))
    for tag in (
        "reward/mean",
        "staleness/mean",
        "staleness/max",
        "is/ratio_mean",
        "is/ess",
        "is/mismatch_kl",
        "is/clip_frac",
        "perf/tokens_per_s_generated",
        "replay/depth",
        "broker/sync_seconds",
        "loss/total",
    ):
        assert tag in tags, tag
    # the actor's idle share is a share of the time since its loop started
    idle = [e.value for e in ea.Scalars("perf/actor_idle_frac")]
    assert idle and all(0 <= v <= 1 for v in idle), idle
    assert (short_run / "checkpoint" / "hf" / "config.json").exists()


def test_resume_continues_the_run(short_run, tmp_path):
    """The CLI's resume: the learner's version, the queue's accounting and the actors'
    prompt streams come back from the checkpoint the short run wrote at its end."""
    before = json.loads((short_run / "summary.json").read_text())
    out = tmp_path / "resumed"
    r = run_cli(out, "max_steps=128", f"resume={short_run / 'checkpoint'}", WITH_STRICT_AT_0)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["policy_version"] == 128 and s["steps"] == 8  # 120 -> 128
    # accounting merged: the saved run's counts plus this run's, the invariant kept
    assert s["trajectories_trained"] >= before["trajectories_trained"] + 8 * 16 * 8 * 0.95
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    assert s["max_staleness_trained"] <= s["max_staleness_bound"]
