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
    names = [c["name"] for c in out["cases"] if c["goal"] == 0.25]
    assert sum(n.startswith("verl fully-async 7B") for n in names) == 6
    assert sum(n.startswith("AReaL v0.3 1.5B") for n in names) == 2 + 6  # two readings, Fig. 7
    for case in out["cases"]:
        assert {"name", "figure", "predicted", "measured", "error", "goal"} <= set(case)
        assert case["predicted"] > 0 and case["error"] == pytest.approx(
            abs(case["predicted"] - case["measured"]) / case["measured"])  # fmt: skip


# One episode of one 10-token turn a batch; the engine decodes one sequence at a time at
# 0.1 s a token (1 s an episode alone) and the learner trains 10 tokens at 0.1 s each
# (1 s a step alone); no publish, pause or hand-off time.
ONE = Workload(batch_groups=1, group_size=1, prompt_tokens=0, turn_tokens=Lognormal(10, 10))
ALONE = AsyncSetup(
    engines=1, cap=1, step0=0.0, step1=0.1, trainers=1, train_fixed_s=0.0, train_token_s=0.1,
    publish_s=0.0, sync_fixed_s=0.0, sync_bytes=0.0, sync_gbps=1.0,
)  # fmt: skip


def seconds_per_step(**kw) -> float:
    sim = AsyncSim(ONE, dataclasses.replace(ALONE, **kw), steps=8, seed=0).run()
    return async_figures(sim, warmup=2)["seconds_per_step"]


def test_parts_sharing_one_core_take_turns_on_it():
    # From the first step on, the learner trains batch k (1 s alone) while the engine
    # decodes episode k + 1 (1 s alone): each on its own device, a step every 1 s.
    assert seconds_per_step() == pytest.approx(1.0)
    # Both on one core: two jobs of 1 s each, each at half speed, both end after 2 s.
    assert seconds_per_step(cpu_cores=1) == pytest.approx(2.0)
    # Two cores for two one-thread parts: nothing shared, 1 s again.
    assert seconds_per_step(cpu_cores=2) == pytest.approx(1.0)
    # Two cores, and one more core's worth always runnable (the driver, other users):
    # 3 runnable on 2 cores, each at 2/3 speed, so 1 s of work takes 1.5 s.
    assert seconds_per_step(cpu_cores=2, background_cpu=1) == pytest.approx(1.5)
    # An engine whose processes keep 3 cores runnable, with the learner's 1, on 2 cores:
    # speed 2/4 for both while both run, 2 s a step.
    assert seconds_per_step(cpu_cores=2, engine_cpu=3) == pytest.approx(2.0)


def test_the_step_overhead_adds_to_a_learner_bound_step():
    # The learner trains 1 s, then the driver's 0.5 s between steps; the engine (1 s an
    # episode) has the next batch ready by then: 1.5 s a step, 1/3 of it the learner idle
    # from the engine's side (the engine waits on the throttle meanwhile, not the learner).
    assert seconds_per_step(step_overhead_s=0.5) == pytest.approx(1.5)


def test_uneven_sharing_reschedules_the_learner_mid_step():
    # One core, episodes of 0.5 s alone (step1 0.05). The engine runs ahead until the
    # throttle holds it (3 batches at bound 2), so each new version lets one episode
    # start as the learner takes its next batch: both at half speed until the episode's
    # 0.5 s of work is done, 1 s later (the learner 0.5 s into its 1 s), then the learner
    # alone on the core for its last 0.5 s. A step every 1.5 s: all the work a step
    # holds (1 + 0.5 s) on one core, none lost to the reschedule.
    assert seconds_per_step(cpu_cores=1, step1=0.05) == pytest.approx(1.5, rel=1e-6)


class QuotaLog(AsyncSim):
    """Records, at every weight update, the groups in the system and, by the next, the
    groups started since."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.windows: list[list[int]] = []  # [in the system at the update, started since]

    def on_publish_done(self) -> None:
        self.windows.append([self.generating + self.queued, 0])
        super().on_publish_done()

    def try_start(self) -> None:
        before = self.started
        super().try_start()
        if self.windows:
            self.windows[-1][1] += self.started - before


def test_the_quota_policy_starts_no_more_than_the_window_left_at_each_update():
    # verl's rule: between two updates, starts <= capacity - groups in the system at the
    # update; learner steps of 4 groups, new weights every 3 of them (12 groups a version;
    # a window under that would hold the learner short for ever)
    cap = 15
    s = dataclasses.replace(SETUP, policy="quota", capacity_groups=cap, publish_every=3,
                            bound=10**6, max_inflight_groups=2)  # fmt: skip
    sim = QuotaLog(TOOL, s, 24, seed=3).run()
    assert len(sim.step_done) == 24 and sim.version == 8
    assert sim.windows and all(left + started <= cap for left, started in sim.windows)
    assert max(started for _, started in sim.windows) > 0
    c = sim.counts
    assert c["produced"] == c["trained"] + c["dropped"] + sim.in_queue()
    # staleness counts weight versions, not learner steps: with at most 15 groups (1.25
    # versions' batches) in the system a group is trained at most 2 versions on
    assert max(sim.staleness) <= 2


def test_a_version_every_publish_every_steps_under_the_throttle():
    sim = run(steps=12, publish_every=4, bound=1)
    assert sim.version == 3
    # the throttle's unit is a version's batch: 4 steps of groups
    assert sim.started <= (sim.version + 1 + 1) * 4 * TOOL.batch_groups
    assert max(sim.staleness) <= 1


def test_a_tensor_parallel_engine_pays_two_all_reduces_a_layer_per_step():
    from benchmarks.simulate import H20, QWEN_7B, TP_ALLREDUCE_S, engine_costs

    _, one, _ = engine_costs(QWEN_7B, H20, 1000)
    _, four, _ = engine_costs(dataclasses.replace(QWEN_7B, tp=4), H20, 1000)
    weights = 2 * QWEN_7B.params / (H20.hbm_tbs * 1e12 * 0.7)
    assert one - four == pytest.approx(weights * 3 / 4 - 2 * QWEN_7B.layers * TP_ALLREDUCE_S)


def test_verl_costs_make_the_sync_generation_last_the_stated_seconds():
    from benchmarks.simulate import VERL, verl_case

    r = verl_case(VERL, updates=3)
    # the bisection matches the stated gen on its own draws; the reported sync side draws
    # DRAWS other batches, whose longest answers differ
    assert r["engine_slowness"] > 0
    assert r["sync"]["generate_seconds"] == pytest.approx(VERL.sync_gen_s, rel=0.25)
    assert r["sync"]["train_seconds"] == pytest.approx(VERL.sync_update_s + VERL.sync_logprob_s,
                                                       rel=0.02)  # fmt: skip
