"""Calibrate benchmarks/simulate.py's 2-core host model on this machine: run the
calibration runs one after the other, read each part's cost from them, and write the
host's costs as one JSON file; put in ``benchmarks/hosts/`` with the pairs measured
after it (simulate_host.load_host), ``simulate --validate`` predicts from it.

    A  asyncrl.train, default job, 100 steps        ─┐ under benchmarks/cpu_by_process.py:
    D  asyncrl.train, vs_sync's tool job, 6 steps    ─┘ CPU seconds by process, host busy
    B, C  the sync loop (vs_sync --sync-worker), default job, 100 steps, 2 threads / 1
    E, E1 the sync loop, tool job, 4 steps, 2 threads / 1
        ▼ costs(): A's steady steps (the 6th to the last) give the asyncrl parts' CPU per
        ▼ token and per second; B-E1 the sync loop's seconds; D's run the tool job's own
    calibration.json: {"host": HostCosts fields, "jobs": {job: JobCosts fields},
                       "sources": what each figure was read from, "session": when, load}

    python -m benchmarks.simulate_calibrate --out DIR          # ~10 min on 2 cores
    python -m benchmarks.simulate_calibrate --out DIR --read   # the costs of runs in DIR

None of these runs is a run that ``--validate`` predicts: run the pairs
(``python -m benchmarks.vs_sync --quick ...``) after the costs are written down.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import ROOT, emit_json, host, parser  # noqa: E402
from benchmarks.simulate_host import (  # noqa: E402
    DEFAULT_JOB,
    TOOL_JOB,
    HostCosts,
    JobCosts,
    hf_step_from,
    train_token_from,
)
from benchmarks.vs_sync import JOBS, prebuild_model, step_wall_times  # noqa: E402

# run name -> (side, job, steps, sync threads; 0: every core)
RUNS: dict[str, tuple[str, str, int, int]] = {
    "A": ("asyncrl", "default", 100, 0),
    "B": ("sync", "default", 100, 0),
    "C": ("sync", "default", 100, 1),
    "D": ("asyncrl", "tool", 6, 0),
    "E": ("sync", "tool", 4, 0),
    "E1": ("sync", "tool", 4, 1),
}
SEED = 1  # the validation pairs run seed 0
# the first step of a run's steady state: A's first 5 steps hold the engine's and the
# learner's warm-up; D has 6 steps in all, each after the first counted
STEADY_FROM = {"A": 6, "D": 2}
# the parts' process names as /proc/<pid>/stat gives them (cut at 15 characters)
ENGINE = "VLLM::EngineCore"[:15]
ACTOR = "ray::RolloutActor"[:15]
LEARNER = "ray::LearnerRank"[:15]


def command(name: str, out: Path) -> list[str]:
    side, job, steps, threads = RUNS[name]
    overrides = [*JOBS[job]["overrides"], f"max_steps={steps}", f"seed={SEED}"]
    if side == "asyncrl":
        inner = [
            "-m",
            "asyncrl.train",
            *overrides,
            "progress=false",
            f"hydra.run.dir={out / 'run'}",
        ]
    else:
        inner = ["-m", "benchmarks.vs_sync", "--sync-worker", "--out", str(out / "run"),
                 "--sync-threads", str(threads), *overrides]  # fmt: skip
    return [sys.executable, "-m", "benchmarks.cpu_by_process", "--out", str(out), "--",
            sys.executable, *inner]  # fmt: skip


def run_all(out: Path) -> None:
    """Each job's model built first (a start-up must not time a one-off build), then each
    calibration run in turn, timed spawn to exit (``wall.json``)."""
    for job in sorted({job for _, job, _, _ in RUNS.values()}):
        print(f"simulate_calibrate: {job} job's model {prebuild_model(JOBS[job]['overrides'])}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in RUNS:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        with (d / "stdout.log").open("w") as so, (d / "stderr.log").open("w") as se:
            r = subprocess.run(command(name, d), cwd=ROOT, env=env, stdout=so, stderr=se)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            tail = (d / "stderr.log").read_text()[-2000:]
            raise SystemExit(
                f"simulate_calibrate: run {name} failed (exit {r.returncode}):\n{tail}"
            )
        (d / "wall.json").write_text(json.dumps(
            {"seconds": wall, "load_start": load0, "load_end": os.getloadavg()[0],
             "ended": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}))  # fmt: skip
        print(f"simulate_calibrate: {name} {wall:.1f} s", flush=True)


def cpu_at(rows: list[dict], t: float) -> dict[str, Any]:
    """The last sample of cpu.jsonl taken at or before ``t`` (the first if none)."""
    before = [r for r in rows if r["t"] <= t]
    return before[-1] if before else rows[0]


def cpu_between(d: Path, t0: float, t1: float) -> tuple[dict[str, float], float, float]:
    """CPU seconds by process name between two wall times, the whole host's busy CPU
    seconds over the same samples, and the samples' own span (s)."""
    rows = [json.loads(x) for x in (d / "cpu.jsonl").read_text().splitlines()]
    a, b = cpu_at(rows, t0), cpu_at(rows, t1)
    names = set(a["cpu"]) | set(b["cpu"])
    by_name = {n: b["cpu"].get(n, 0.0) - a["cpu"].get(n, 0.0) for n in names}
    return by_name, b["host_busy"] - a["host_busy"], b["t"] - a["t"]


def tb_mean(tags: dict[str, tuple[list[int], list[float]]], tag: str, first: int) -> float:
    """Mean of ``tag`` over the steps from ``first`` on."""
    steps, vals = tags[tag]
    kept = [v for s, v in zip(steps, vals) if s >= first]
    return statistics.fmean(kept)


def asyncrl_costs(d: Path, first: int) -> dict[str, Any]:
    """An asyncrl run's figures over its steps from ``first`` on: CPU by part, and the
    step's fixed costs."""
    from asyncrl.tools.report import scalars

    run = d / "run"
    summary = json.loads((run / "summary.json").read_text())
    times = step_wall_times(run / "tb")
    t0, t1 = times[first - 1], times[-1]
    steps = len(times) - first
    cpu, busy, span = cpu_between(d, t0, t1)
    tags = scalars(run)
    tokens_per_step = summary["tokens_generated"] / summary["steps"]
    batch_tokens = tb_mean(tags, "learner/batch_tokens", first)
    intervals = [b - a for a, b in zip(times[first - 1 :], times[first:])]
    split = [tb_mean(tags, t, first) for t in ("perf/train_seconds", "perf/wait_seconds",
                                                "perf/publish_seconds")]  # fmt: skip
    own = sum(cpu.values())
    engine = cpu.get(ENGINE, 0.0)
    seconds_per_step = (t1 - t0) / steps
    # the share of a core the learner got while it trained: its CPU a step over its
    # training's wall seconds a step (perf/train_seconds)
    learner_share = cpu.get(LEARNER, 0.0) / steps / split[0]
    return {
        "steps": steps,
        "all_steps": len(times),
        "seconds": t1 - t0,
        "seconds_per_step": seconds_per_step,
        "cpu": cpu,
        "engine_token_s": engine / (steps * tokens_per_step),
        "engine_and_actor_over_engine": (engine + cpu.get(ACTOR, 0.0)) / engine,
        "learner_share": learner_share,
        "learner_token_s": cpu.get(LEARNER, 0.0) / (steps * batch_tokens),
        "background_cpu": (own - engine - cpu.get(ACTOR, 0.0) - cpu.get(LEARNER, 0.0)) / span,
        "foreign_cpu": max(busy - own, 0.0) / span,
        "step_overhead_s": statistics.fmean(intervals) - sum(split),
        "publish_s": split[2],
        "pause_s": tb_mean(tags, "broker/pause_seconds_max", first),
        "tokens_per_step": tokens_per_step,
        "batch_tokens": batch_tokens,
        "startup_s": summary["startup_seconds"],
        "wall_s": json.loads((d / "wall.json").read_text())["seconds"],
        "calls_mean": tb_mean(tags, "env/tool_calls_mean", 1) if "env/tool_calls_mean" in tags else None,
    }  # fmt: skip


def sync_costs(d: Path) -> dict[str, Any]:
    """A sync loop run's seconds: generating and training a step, and its start-up (the
    wall clock less its steps)."""
    f = json.loads((d / "run" / "sync_summary.json").read_text())
    wall = json.loads((d / "wall.json").read_text())["seconds"]
    n = f["steps"]
    return {
        "seconds_per_step": f["seconds_per_step"],
        "generate_s": f["generate_seconds_per_step"],
        "env_wait_s": f.get("env_wait_seconds_per_step", 0.0),
        "train_s": f["train_seconds_per_step"],
        "startup_s": wall - n * f["seconds_per_step"],
        "wall_s": wall,
        "steps": n,
    }


def engine_cpu(cores: float, a: dict[str, Any]) -> float:
    """The cores a decoding engine keeps runnable, read from what the learner got beside
    it: AsyncSim shares ``cores - foreign_cpu`` among background_cpu, the learner's one
    core and the engine's demand, so the learner's measured share while it trained gives
    that demand. (The engine core's and its actor's CPU over the engine core's,
    ``engine_and_actor_over_engine``, counts both as runnable all the time they decode;
    they take turns for part of it.)"""
    demand = (cores - a["foreign_cpu"]) / min(a["learner_share"], 1.0) - 1.0 - a["background_cpu"]
    return max(demand, 0.0)


def handoff_s() -> float:
    """A finished group's mean wait before it travels: half of ``actor.handoff_linger_ms``
    (the runs keep conf/'s)."""
    from asyncrl.actor.settings import ActorSettings

    return ActorSettings.defaults().handoff_linger_s / 2


def missing_runs(out: Path) -> list[str]:
    """The calibration runs of ``RUNS`` without a finished run in ``out``."""
    return [k for k in RUNS if not (out / k / "wall.json").is_file()]


def costs(out: Path) -> dict[str, Any]:
    """HostCosts and each job's JobCosts from the runs in ``out``, with their sources."""
    a, d = (asyncrl_costs(out / k, STEADY_FROM[k]) for k in ("A", "D"))
    sync = {k: sync_costs(out / k) for k in ("B", "C", "E", "E1")}
    cores = float(os.cpu_count() or 2)
    hc = HostCosts(
        cores=cores, foreign_cpu=a["foreign_cpu"], engine_cap=64,
        engine_token_s=a["engine_token_s"], engine_cpu=engine_cpu(cores, a),
        background_cpu=a["background_cpu"], learner_token_s=a["learner_token_s"],
        step_overhead_s=a["step_overhead_s"], publish_s=a["publish_s"], pause_s=a["pause_s"],
        handoff_s=handoff_s(),
    )  # fmt: skip

    def job(w, s, r) -> JobCosts:
        return JobCosts(
            hf_step1=hf_step_from(w, s["generate_s"]), sync_train_token_s=train_token_from(w, s["train_s"]),
            sync_startup_s=s["startup_s"], async_startup_s=r["startup_s"],
            async_shutdown_s=r["wall_s"] - r["startup_s"] - (r["all_steps"] - 1) * r["seconds_per_step"],
        )  # fmt: skip

    jobs = {
        "default": job(DEFAULT_JOB, sync["B"], a),
        "default, sync on 1 thread": job(DEFAULT_JOB, sync["C"], a),
        "tool": job(TOOL_JOB, sync["E"], d),
        "tool, sync on 1 thread": job(TOOL_JOB, sync["E1"], d),
    }
    walls = {k: json.loads((out / k / "wall.json").read_text()) for k in RUNS}
    return {
        "host": dataclasses.asdict(hc),
        "jobs": {k: dataclasses.asdict(j) for k, j in jobs.items()},
        "runs": {"A": a, "D": d, **sync},
        "sources": {k: " ".join(command(k, Path(f"<out>/{k}"))[3:]) for k in RUNS},
        "session": {"host": host(), "runs": walls},
    }


def main() -> None:
    p = parser("simulate_calibrate", __doc__)
    p.add_argument("--read", action="store_true", help="read the runs already in --out")
    args = p.parse_args()
    if not args.read:
        args.out.mkdir(parents=True, exist_ok=True)
        run_all(args.out)
    elif missing := missing_runs(args.out):
        raise SystemExit(
            f"simulate_calibrate: --read: no finished run {', '.join(missing)} in {args.out} "
            "(run without --read first)"
        )
    c = costs(args.out)
    (args.out / "calibration.json").write_text(json.dumps(c, indent=1))
    emit_json({"host": c["host"], "jobs": c["jobs"], "file": str(args.out / "calibration.json")})


if __name__ == "__main__":
    main()
