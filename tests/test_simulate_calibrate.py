"""benchmarks/simulate_calibrate.py reads each part's cost from the calibration runs'
files: CPU seconds by process between two step times, the host's busy CPU beside the
run's own, the step's fixed costs from the run's TensorBoard figures, and the sync loop's
seconds; and a host file it wrote is what ``simulate --validate`` predicts from."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.simulate_calibrate import (  # noqa: E402
    ACTOR,
    ENGINE,
    LEARNER,
    RUNS,
    STEADY_FROM,
    costs,
    cpu_between,
)
from benchmarks.simulate_host import (  # noqa: E402
    HOSTS_DIR,
    TOOL_JOB,
    HostCosts,
    calibrated_hosts,
    load_host,
)

T0 = 1_000_000.0
STEP_S = 0.25  # every step of the made-up runs
TOKENS = 400  # generated a step
BATCH = 1000  # trained a step
ENGINE_RATE, ACTOR_RATE, LEARNER_RATE, OTHER_RATE = 0.8, 0.4, 0.3, 0.1  # cores each
TRAIN_S = 0.1  # perf/train_seconds: the learner trains at LEARNER_RATE * STEP_S / TRAIN_S
FOREIGN = 0.2  # cores other processes took


def write_asyncrl_run(d: Path, steps: int, startup: float, calls: float | None) -> None:
    """A run's files as asyncrl.train and cpu_by_process write them: CPU growing at a fixed
    rate per part, a step every STEP_S from ``startup`` on."""
    from torch.utils.tensorboard import SummaryWriter

    run = d / "run"
    run.mkdir(parents=True)
    start = T0 + startup
    w = SummaryWriter(str(run / "tb"))
    for s in range(1, steps + 1):
        t = start + (s - 1) * STEP_S
        for tag, v in (("reward/mean", 0.5), ("learner/batch_tokens", BATCH),
                       ("perf/train_seconds", TRAIN_S), ("perf/wait_seconds", 0.08),
                       ("perf/publish_seconds", 0.03), ("broker/pause_seconds_max", 0.04)):  # fmt: skip
            w.add_scalar(tag, v, s, walltime=t)
        if calls is not None:
            w.add_scalar("env/tool_calls_mean", calls, s, walltime=t)
    w.close()
    (run / "summary.json").write_text(json.dumps(
        {"steps": steps, "tokens_generated": steps * TOKENS, "startup_seconds": startup}))  # fmt: skip
    rows = []
    for i in range(int((startup + steps * STEP_S + 2) / 0.5)):
        t = T0 + i * 0.5
        cpu = {ENGINE: ENGINE_RATE * (t - T0), ACTOR: ACTOR_RATE * (t - T0),
               LEARNER: LEARNER_RATE * (t - T0), "python asyncrl.train": OTHER_RATE * (t - T0)}  # fmt: skip
        busy = sum(cpu.values()) + FOREIGN * (t - T0)
        rows.append({"t": t, "cpu": cpu, "host_busy": busy, "host_steal": 0.0})
    (d / "cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "wall.json").write_text(json.dumps({"seconds": startup + (steps - 1) * STEP_S + 3.0}))


def write_sync_run(d: Path, steps: int, gen: float, train: float, startup: float) -> None:
    (d / "run").mkdir(parents=True)
    (d / "run" / "sync_summary.json").write_text(json.dumps(
        {"steps": steps, "seconds_per_step": gen + train, "generate_seconds_per_step": gen,
         "env_wait_seconds_per_step": 0.0, "train_seconds_per_step": train}))  # fmt: skip
    (d / "wall.json").write_text(json.dumps({"seconds": startup + steps * (gen + train)}))


@pytest.fixture
def runs(tmp_path):
    for name, (side, job, steps, _) in RUNS.items():
        if side == "asyncrl":
            write_asyncrl_run(tmp_path / name, steps, 20.0 if job == "default" else 40.0,
                              None if job == "default" else 0.5)  # fmt: skip
        else:
            write_sync_run(tmp_path / name, steps, 0.05, 0.07, 10.0)
    return tmp_path


def test_cpu_between_two_step_times_is_each_parts_growth_and_the_hosts(runs):
    cpu, busy, span = cpu_between(runs / "A", T0 + 10.2, T0 + 20.2)
    assert span == pytest.approx(10.0)
    assert cpu[ENGINE] == pytest.approx(ENGINE_RATE * 10)
    assert busy == pytest.approx(
        (ENGINE_RATE + ACTOR_RATE + LEARNER_RATE + OTHER_RATE + FOREIGN) * 10
    )


def test_costs_are_cpu_per_token_and_per_second_over_the_steady_steps(runs):
    c = costs(runs)
    h = HostCosts(**c["host"])
    # the engine core's CPU per generated token, its actor's beside it
    assert h.engine_token_s == pytest.approx(ENGINE_RATE * STEP_S / TOKENS, rel=0.05)
    # the engine's demand that leaves the learner the share of a core it got
    share = LEARNER_RATE * STEP_S / TRAIN_S
    assert h.engine_cpu == pytest.approx(
        (os.cpu_count() - FOREIGN) / share - 1 - OTHER_RATE, rel=0.05
    )
    assert c["runs"]["A"]["engine_and_actor_over_engine"] == pytest.approx(
        (ENGINE_RATE + ACTOR_RATE) / ENGINE_RATE, rel=0.05
    )
    assert h.learner_token_s == pytest.approx(LEARNER_RATE * STEP_S / BATCH, rel=0.05)
    assert h.background_cpu == pytest.approx(OTHER_RATE, rel=0.05)
    assert h.foreign_cpu == pytest.approx(FOREIGN, rel=0.05)
    # a step's interval less its train, wait and publish seconds
    assert h.step_overhead_s == pytest.approx(STEP_S - TRAIN_S - 0.08 - 0.03, abs=1e-6)
    assert (h.publish_s, h.pause_s) == pytest.approx((0.03, 0.04))
    a = c["runs"]["A"]
    assert a["steps"] == RUNS["A"][2] - STEADY_FROM["A"]
    assert c["runs"]["D"]["calls_mean"] == pytest.approx(0.5)
    jobs = c["jobs"]
    assert jobs["default"]["sync_startup_s"] == pytest.approx(10.0)
    assert jobs["default"]["async_startup_s"] == pytest.approx(20.0)
    # shut-down: the wall clock less start-up and every step after the first
    assert jobs["default"]["async_shutdown_s"] == pytest.approx(3.0, abs=1e-6)
    assert set(jobs) == {"default", "default, sync on 1 thread", "tool", "tool, sync on 1 thread"}


def test_a_host_file_of_those_costs_predicts_its_cases(runs, tmp_path):
    c = costs(runs)
    measured = {"ratio": 1.0, "total_ratio": 1.0}
    f = tmp_path / "host.json"
    f.write_text(json.dumps({"name": "HOST_T", "calibration": c, "cases": {
        "tool pair": {"job": "tool", "steps": 12, "measured": measured, "source": "made up"}}}))  # fmt: skip
    h = load_host(f)
    assert h.host == HostCosts(**c["host"])
    w, _ = h.jobs["tool"]
    assert w == dataclasses.replace(TOOL_JOB, calls_mean=0.5)
    assert set(h.cases) == {"tool pair"}


def test_every_committed_host_file_loads_with_its_cases():
    hosts = calibrated_hosts()
    assert len(hosts) == len(list(HOSTS_DIR.glob("*.json")))
    for h in hosts:
        assert h.host.cores > 0 and h.host.engine_token_s > 0
        assert all(job in h.jobs for job, *_ in h.cases.values())


def test_read_without_the_runs_is_one_line_naming_them(tmp_path):
    import subprocess

    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "wall.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.simulate_calibrate", "--out", str(tmp_path), "--read"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"simulate_calibrate: --read: no finished run B, C, D, E, E1 in {tmp_path} "
        "(run without --read first)"
    ]
    assert not (tmp_path / "calibration.json").exists()
