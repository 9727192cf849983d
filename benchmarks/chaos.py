"""Does a run survive its parts dying? The default job run twice, one after the other,
each a fresh ``python -m asyncrl.train`` process with the same seed and config:

    clean:  undisturbed
    chaos:  SIGKILLed from outside while it trains, at fixed policy versions (read
            from its TensorBoard events): the rollout actor's process, then its vLLM
            engine-core process, then the rollout actor again, then the learner rank.
            Each fault waits until the run has recovered from the one before.

The victims are found in the driver's process tree by their titles (``ray::RolloutActor``,
``VLLM::EngineCore``, ``ray::Learner``), exactly as an operator's ``kill -9`` would.
A fault has recovered when a new process holds the killed role and the run has logged
a step since it appeared; ``recovery_seconds`` is the kill to that step.

Figures, last stdout line (JSON):

    recovered            the chaos run exited 0 at max_steps and every fault recovered
    faults               faults injected
    recovery_seconds     per fault, kill to the first step after the replacement came up
    unaccounted          produced - trained - dropped - in flight, from the chaos run's
                         summary.json: must be 0 (``trajectories_dropped_stale`` counts
                         every dropped trajectory, those a learner restart threw away,
                         ``trajectories_dropped_restart``, included)
    reward_mean_last     the chaos run's summary.json ``reward_mean_last``
    clean_reward_mean_last   the undisturbed run's
    parts_readable       every Parquet part of the chaos run's trajectory log reads

and, from the chaos run's summary.json, its own clocks: ``run_actor_recovery_seconds``
(death seen -> the new actor's first group) and ``run_learner_restart_seconds`` (death
seen -> the first step after the restart).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import ROOT, emit_json, parser, print_table, process_tree  # noqa: E402

# role -> how its process's title starts (Ray names actor processes ray::<Class>, vLLM
# its engine core VLLM::EngineCore)
TITLES = {"actor": "ray::RolloutActor", "engine": "VLLM::EngineCore", "learner": "ray::Learner"}
# (role, policy version at which it is killed); the learner last: its restart resumes
# from the newest checkpoint (learner.checkpoint_every)
QUICK = {"steps": 60, "checkpoint_every": 10,
         "faults": [("actor", 8), ("engine", 20), ("actor", 32), ("learner", 44)]}  # fmt: skip
FULL = {"steps": 150, "checkpoint_every": 10,
        "faults": [("actor", 20), ("engine", 50), ("actor", 80), ("learner", 110)]}  # fmt: skip
RUN_TIMEOUT_S = 1800  # one run; a run that outlives this is hung
POLL_S = 0.5


@dataclass
class Fault:
    role: str
    at_version: int
    pid: int = 0
    killed_at: float = 0.0
    replaced_at: float = 0.0  # a new process holds the role
    recovered_at: float = 0.0  # ... and a step was logged since
    note: str = ""

    @property
    def recovery_seconds(self) -> float | None:
        return round(self.recovered_at - self.killed_at, 2) if self.recovered_at else None


@dataclass
class Outcome:
    code: int
    wall_seconds: float
    summary: dict[str, Any] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)


def role_pids(driver: int, role: str) -> list[int]:
    """Live processes of ``role`` in the driver's process tree."""
    title = TITLES[role]
    out = []
    for pid in process_tree(driver):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        # "ray::Learner" or "ray::Learner.train_step", never "ray::LearnerSomething"
        if cmd == title or cmd.startswith((title + ".", title + " ")):
            out.append(pid)
    return out


class Steps:
    """The newest policy version the run logged, and when (its TensorBoard events)."""

    def __init__(self, tb: Path):
        self.tb = tb
        self._ea = None
        self.last, self.last_at = 0, 0.0

    def poll(self) -> int:
        if not self.tb.is_dir():
            return self.last
        if self._ea is None:
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            self._ea = EventAccumulator(str(self.tb), size_guidance={"scalars": 0})
        self._ea.Reload()
        if "reward/mean" in self._ea.Tags()["scalars"]:
            events = self._ea.Scalars("reward/mean")
            newest = max(events, key=lambda e: e.wall_time)
            if newest.wall_time > self.last_at:
                self.last, self.last_at = newest.step, newest.wall_time
        return self.last


def run(out: Path, overrides: list[str], faults: list[Fault]) -> Outcome:
    """Spawn one run; kill ``faults`` in order as it reaches their versions."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    cmd = [sys.executable, "-m", "asyncrl.train", *overrides, "progress=false",
           f"hydra.run.dir={out}"]  # fmt: skip
    t0 = time.time()
    with (out / "stdout.log").open("w") as so, (out / "stderr.log").open("w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se)
        steps, todo, waiting = Steps(out / "tb"), list(faults), None
        try:
            while proc.poll() is None:
                if time.time() - t0 > RUN_TIMEOUT_S:
                    proc.kill()
                    raise SystemExit(f"chaos: the run in {out} outlived {RUN_TIMEOUT_S}s")
                time.sleep(POLL_S)
                version = steps.poll()
                if waiting is not None:
                    waiting = _follow(proc.pid, waiting, steps)
                if waiting is None and todo and version >= todo[0].at_version:
                    waiting = _kill(proc.pid, todo.pop(0))
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return Outcome(proc.returncode, time.time() - t0, summary, faults)


def _kill(driver: int, f: Fault) -> Fault | None:
    pids = role_pids(driver, f.role)
    if not pids:
        f.note = f"no {TITLES[f.role]} process to kill"
        return None
    f.pid, f.killed_at = pids[0], time.time()
    os.kill(f.pid, signal.SIGKILL)
    print(f"chaos: killed {f.role} (pid {f.pid}) at version >= {f.at_version}", flush=True)
    return f


def _follow(driver: int, f: Fault, steps: Steps) -> Fault | None:
    """None once ``f`` has recovered (the next fault may go)."""
    if not f.replaced_at:
        new = [p for p in role_pids(driver, f.role) if p != f.pid]
        if new:
            f.replaced_at = time.time()
    if f.replaced_at and steps.last_at > f.replaced_at:
        f.recovered_at = steps.last_at
        print(f"chaos: {f.role} recovered in {f.recovery_seconds} s", flush=True)
        return None
    return f


def parts_readable(run_dir: Path) -> bool:
    import pyarrow.parquet as pq

    from asyncrl.utils.runlog import trajectory_parts

    parts = trajectory_parts(run_dir)
    try:
        for p in parts:
            pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - the figure is whether it reads
        print(f"chaos: {p} does not read: {type(e).__name__}: {e}", flush=True)
        return False
    return bool(parts)


def unaccounted(s: dict[str, Any]) -> int | None:
    if "trajectories_produced" not in s:
        return None
    return (
        s["trajectories_produced"]
        - s["trajectories_trained"]
        - s["trajectories_dropped_stale"]
        - s["trajectories_in_flight"]
    )


def main() -> None:
    p = parser("chaos", __doc__)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run")
    args = p.parse_args()
    plan = QUICK if args.quick else FULL
    steps = args.steps or plan["steps"]
    overrides = [f"max_steps={steps}", f"learner.checkpoint_every={plan['checkpoint_every']}"]
    faults = [Fault(role, v) for role, v in plan["faults"] if v < steps]
    out = args.out
    clean = run(out / "clean", overrides, [])
    chaos = run(out / "chaos", overrides, faults)
    rows = [(f.role, f.at_version, f.pid, f.recovery_seconds, f.note) for f in faults]
    print_table("faults", ["role", "at version", "pid", "recovery s", "note"], rows)
    done = chaos.code == 0 and chaos.summary.get("policy_version") == steps
    figures = {
        "recovered": bool(done and all(f.recovered_at for f in faults)),
        "faults": sum(bool(f.killed_at) for f in faults),
        "recovery_seconds": [f.recovery_seconds for f in faults if f.killed_at],
        "unaccounted": unaccounted(chaos.summary),
        "reward_mean_last": chaos.summary.get("reward_mean_last"),
        "clean_reward_mean_last": clean.summary.get("reward_mean_last"),
        "parts_readable": parts_readable(out / "chaos"),
        # the run's own clocks: detection -> first group of the new actor; detection ->
        # first step after a learner restart (summary.json, asyncrl/fault)
        "run_actor_recovery_seconds": chaos.summary.get("fault", {}).get("recovery_seconds"),
        "run_learner_restart_seconds": chaos.summary.get("restart_seconds"),
        "chaos_exit_code": chaos.code,
        "clean_exit_code": clean.code,
        "chaos_wall_seconds": round(chaos.wall_seconds, 1),
        "clean_wall_seconds": round(clean.wall_seconds, 1),
        "steps": steps,
        "load_1min": os.getloadavg()[0],
    }
    (out / "chaos.json").write_text(json.dumps(figures, indent=2))
    emit_json(figures)


if __name__ == "__main__":
    main()
