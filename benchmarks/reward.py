"""What a slow reward costs the generation path: the default job run twice in this
process, one run after the other, with the same reward workers:

    instant: asyncrl.rewards.delayed.DelayedTaskReward(delay_s=0)    the task's reward,
    slow:    asyncrl.rewards.delayed.DelayedTaskReward(delay_s=0.2)  200 ms per episode
             (an ``asyncio.sleep`` inside ``score``: a remote verifier's latency)

Both go through the pool (``reward.workers`` Ray actors, asyncrl/rewards/pool.py): the
rollout actor hands each finished group over and keeps generating the others; the
group's slot stays taken until its rewards come back. So the slow reward costs
throughput only where the slots (``actor.max_inflight_groups``) or the staleness
window (``replay.max_staleness``: the queue grants at most (max_staleness + 2) x
batch_groups slots) run out before the rewards return.

The clock covers the steps after the first ``--warmup`` (the batches generated while
the parts started are used up by then). Figures, last stdout line (JSON):

    tokens_per_s_instant / tokens_per_s_slow   response tokens trained per second over
                                               the window (= generated, in steady state)
    ratio                                      slow / instant (goal >= 0.9)
    reward_workers                             reward.workers of both runs

The CSV has a row per run with its window, learner wait share, staleness and actor
idle share, which say where a missing throughput went.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Recorder,
    compose,
    emit_json,
    fingerprint_columns,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    start_ray,
    stop_all,
    write_csv,
)

SLOW_S = 0.2  # the slow reward's latency per episode (the 200 ms)
DELAYED = "asyncrl.rewards.delayed.DelayedTaskReward"
MODES = {"instant": 0.0, "slow": SLOW_S}


def reward_override(delay_s: float) -> str:
    return f"reward.components=[{{_target_: {DELAYED}, weight: 1.0, delay_s: {delay_s}}}]"


class TimedRecorder(Recorder):
    """Every step's metrics and the wall time it was logged at."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        self.times.append(time.perf_counter())


def window_row(mode: str, rec: TimedRecorder, warmup: int) -> dict[str, Any]:
    """The measured window's figures: steps after ``warmup`` to the last."""
    window = rec.times[-1] - rec.times[warmup - 1]
    measured = rec.steps[warmup:]
    tokens = sum(s["tokens/trained"] for s in measured)
    wait = sum(s.get("perf/wait_seconds", 0.0) for s in measured)
    return {
        "mode": mode,
        "steps_timed": len(measured),
        "seconds": window,
        "tokens_per_s": tokens / window,
        "learner_wait_frac": wait / window,  # the learner waiting for a batch
        "staleness_mean": sum(s["staleness/mean"] for s in measured) / len(measured),
        "actor_idle_frac": measured[-1].get("perf/actor_idle_frac", float("nan")),
        "reward_mean": sum(s["reward/mean"] for s in measured) / len(measured),
        "reward_errors": sum(s["reward/errors"] for s in measured),
    }


def run_mode(mode: str, overrides: list[str], steps: int, warmup: int, out: Path):
    from asyncrl.loop import run_loop
    from asyncrl.wiring import prepare, start_parts

    cfg = compose(*overrides, reward_override(MODES[mode]), f"max_steps={steps}",
                  "progress=false")  # fmt: skip
    setup = prepare(cfg)
    fp = fingerprint_columns(run_fingerprint(cfg, setup.model_path, cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    parts = start_parts(setup, out, started_ray=False)
    rec = TimedRecorder()
    try:
        run_loop(cfg, parts, rec)
    finally:
        stop_all(parts)
    row = window_row(mode, rec, warmup)
    row.update(reward_workers=setup.reward.workers, delay_s=MODES[mode], **fp)
    return row, rec


def figures_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The JSON figures from the two runs' rows (instant first)."""
    instant, slow = rows
    return {
        "tokens_per_s_instant": instant["tokens_per_s"],
        "tokens_per_s_slow": slow["tokens_per_s"],
        "ratio": ratio(slow["tokens_per_s"], instant["tokens_per_s"]),
        "reward_workers": instant["reward_workers"],
    }


def arguments(argv: list[str] | None = None):
    p = parser("reward", __doc__)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run")
    p.add_argument("--warmup", type=int, default=None, help="steps before the clock starts")
    p.add_argument("overrides", nargs="*", help="training-config overrides for both runs")
    args = p.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else 200)
    args.warmup = args.warmup or (10 if args.quick else 20)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def plot(out: Path, curves: dict[str, list[float]], warmup: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, times in curves.items():
        ax.plot([t - times[0] for t in times], range(1, len(times) + 1), label=mode)
    ax.axhline(warmup, color="grey", lw=0.5)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("learner steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)


def main() -> None:
    args = arguments()
    import ray

    start_ray()
    rows, curves = [], {}
    try:
        for mode in MODES:
            row, rec = run_mode(mode, args.overrides, args.steps, args.warmup, args.out / mode)
            rows.append(row)
            curves[mode] = rec.times
            print(f"{mode}: {row['seconds']:.1f} s for {row['steps_timed']} steps",
                  file=sys.stderr)  # fmt: skip
    finally:
        ray.shutdown()
    figures = figures_of(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "reward.csv", rows, fingerprint=run_fingerprint())
    plot(args.out, curves, args.warmup)
    cols = ["mode", "tokens_per_s", "seconds", "learner_wait_frac", "staleness_mean",
            "actor_idle_frac", "reward_mean", "reward_errors"]  # fmt: skip
    print_table("reward latency vs throughput", cols, [[r[c] for c in cols] for r in rows])
    print(f"load (1/5/15 min): {os.getloadavg()}; outputs: {args.out}")
    emit_json(figures)


if __name__ == "__main__":
    main()
