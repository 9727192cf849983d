"""What a slow reward costs the generation path: the default job with its reward through
the reward workers (asyncrl/rewards/pool.py), the reward

    instant: asyncrl.rewards.delayed.DelayedTaskReward(delay_s=0)    the task's reward,
    slow:    asyncrl.rewards.delayed.DelayedTaskReward(delay_s=0.2)  200 ms per episode
             (an ``asyncio.sleep`` inside ``score``: a remote verifier's latency)

**Interleaved (the default): one run, same workers, same engine.** The reward is slow
in every other turn of ``--period`` seconds (``DelayedTaskReward(period_s, epoch)``)
and instant in the others. Each turn's first ``--settle`` seconds are not counted (the
pipeline still holds groups scored in the turn before); the rest of every instant turn
and of every slow turn are summed. Why not two runs one after the other (``--separate``,
the old method): on this machine the same default job runs at 0.17 s a step in some
minutes and 0.33 in others (the host's speed, not ours: a learner step's pure compute
halves too), so two runs compare the host's moods more than the rewards'.

The rollout actor hands each finished group over and keeps generating the others; the
group's slot stays taken until its rewards come back. So the slow reward costs
throughput only where the slots (``actor.max_inflight_groups``) or the staleness
window (``replay.max_staleness``) run out before the rewards return.

Figures, last stdout line (JSON):

    tokens_per_s_instant / tokens_per_s_slow   response tokens trained per second over
                                               the counted time of each (= generated,
                                               in steady state)
    ratio                                      slow / instant (goal >= 0.9)
    reward_workers                             reward.workers of the run
    turns_instant / turns_slow, ratio_pairs_min / _median / _max
                                               interleaved: the turns counted, and the
                                               ratio of each slow turn to the instant
                                               turns on either side (the spread)

The CSV has a row per turn (per run with --separate) with its learner wait share,
staleness and reward, which say where a missing throughput went.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
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
PERIOD_S = 10.0  # interleaved: seconds of each turn
SETTLE_S = 3.0  # interleaved: seconds at the start of a turn not counted


def reward_override(delay_s: float, period_s: float = 0.0, epoch: float = 0.0) -> str:
    turns = f", period_s: {period_s}, epoch: {epoch}" if period_s else ""
    return f"reward.components=[{{_target_: {DELAYED}, weight: 1.0, delay_s: {delay_s}{turns}}}]"


class TimedRecorder(Recorder):
    """Every step's metrics and the times it was logged at (``times``: the monotonic
    clock; ``wall``: Unix seconds, the clock the reward's turns follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.wall: list[float] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        self.times.append(time.perf_counter())
        self.wall.append(time.time())


def window_row(mode: str, rec: TimedRecorder, warmup: int) -> dict[str, Any]:
    """--separate: the measured window's figures, steps after ``warmup`` to the last."""
    window = rec.times[-1] - rec.times[warmup - 1]
    row = _sums(rec.steps[warmup:], window)
    row.update(mode=mode, actor_idle_frac=rec.steps[-1].get("perf/actor_idle_frac", float("nan")))
    return row


def _sums(measured: list[dict[str, float]], seconds: float) -> dict[str, Any]:
    n = max(len(measured), 1)
    return {
        "steps_timed": len(measured),
        "seconds": seconds,
        "tokens": sum(s["tokens/trained"] for s in measured),
        "tokens_per_s": sum(s["tokens/trained"] for s in measured) / seconds if seconds else 0.0,
        # the learner waiting for a batch
        "learner_wait_frac": sum(s.get("perf/wait_seconds", 0.0) for s in measured)
        / (seconds or 1),
        "staleness_mean": sum(s["staleness/mean"] for s in measured) / n,
        "reward_mean": sum(s["reward/mean"] for s in measured) / n,
        "reward_errors": sum(s["reward/errors"] for s in measured),
    }


def turn_rows(
    rec: TimedRecorder, warmup: int, epoch: float, period_s: float, settle_s: float
) -> list[dict[str, Any]]:
    """Interleaved: one row per turn of the reward, from the steps after ``warmup`` that
    began at least ``settle_s`` into a turn and ended in it (a step's seconds are those
    since the step before)."""
    from asyncrl.rewards.delayed import delayed_at

    by_turn: dict[int, tuple[list, float]] = {}
    for i in range(max(warmup, 1), len(rec.wall)):
        t0, t1 = rec.wall[i - 1], rec.wall[i]
        k = math.floor((t1 - epoch) / period_s)
        if t0 - (epoch + k * period_s) < settle_s:
            continue  # in the turn's first seconds, or begun in the turn before
        steps, secs = by_turn.get(k, ([], 0.0))
        by_turn[k] = (steps + [rec.steps[i]], secs + t1 - t0)
    rows = []
    for k, (steps, secs) in sorted(by_turn.items()):
        slow = delayed_at(epoch + (k + 0.5) * period_s, epoch, period_s)
        rows.append({"mode": "slow" if slow else "instant", "turn": k, **_sums(steps, secs)})
    return rows


def interleaved_figures(rows: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """The JSON figures from the turns: each mode's tokens over its counted seconds, and
    the ratio of every slow turn to the instant turns on either side of it (their mean)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        secs = sum(r["seconds"] for r in mine)
        out[f"tokens_per_s_{mode}"] = sum(r["tokens"] for r in mine) / secs if secs else 0.0
        out[f"turns_{mode}"] = len(mine)
    by_turn = {r["turn"]: r["tokens_per_s"] for r in rows}
    pairs = []
    for r in rows:
        around = [by_turn[k] for k in (r["turn"] - 1, r["turn"] + 1) if k in by_turn]
        if r["mode"] == "slow" and around:
            pairs.append(ratio(r["tokens_per_s"], sum(around) / len(around)))
    pairs.sort()
    figures = {
        "tokens_per_s_instant": out["tokens_per_s_instant"],
        "tokens_per_s_slow": out["tokens_per_s_slow"],
        "ratio": ratio(out["tokens_per_s_slow"], out["tokens_per_s_instant"]),
        "reward_workers": workers,
        "method": "interleaved",
        "turns_instant": out["turns_instant"],
        "turns_slow": out["turns_slow"],
    }
    if pairs:
        figures.update(ratio_pairs_min=pairs[0], ratio_pairs_median=statistics.median(pairs),
                       ratio_pairs_max=pairs[-1])  # fmt: skip
    return figures


def run_once(overrides: list[str], reward: str, steps: int, out: Path):
    """One training run of the default job with ``reward``; returns (reward workers,
    recorder, the run's fingerprint columns)."""
    from asyncrl.loop import run_loop
    from asyncrl.wiring import prepare, start_parts

    cfg = compose(*overrides, reward, f"max_steps={steps}", "progress=false")
    setup = prepare(cfg)
    fp = fingerprint_columns(run_fingerprint(cfg, setup.model_path, cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    parts = start_parts(setup, out, started_ray=False)
    rec = TimedRecorder()
    try:
        run_loop(cfg, parts, rec)
    finally:
        stop_all(parts)
    return setup.reward.workers, rec, fp


def figures_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """--separate: the JSON figures from the two runs' rows (instant first)."""
    instant, slow = rows
    return {
        "tokens_per_s_instant": instant["tokens_per_s"],
        "tokens_per_s_slow": slow["tokens_per_s"],
        "ratio": ratio(slow["tokens_per_s"], instant["tokens_per_s"]),
        "reward_workers": instant["reward_workers"],
        "method": "separate",
    }


def arguments(argv: list[str] | None = None):
    p = parser("reward", __doc__)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run")
    p.add_argument("--warmup", type=int, default=None, help="steps before the clock starts")
    p.add_argument(
        "--separate",
        action="store_true",
        help="two runs one after the other (instant, then slow), not interleaved",
    )
    p.add_argument("--period", type=float, default=PERIOD_S, help="interleaved: seconds a turn")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="interleaved: seconds at a turn's start not counted")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="training-config overrides for both runs")
    args = p.parse_args(argv)
    if args.separate:
        args.steps = args.steps or (40 if args.quick else 200)
    else:
        args.steps = args.steps or (300 if args.quick else 1200)
    args.warmup = args.warmup or (10 if args.quick else 20)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if not 0 <= args.settle < args.period:
        p.error("--settle must be >= 0 and below --period")
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


def separate(args) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, list[float]]]:
    rows, curves = [], {}
    for mode, delay in MODES.items():
        workers, rec, fp = run_once(
            args.overrides, reward_override(delay), args.steps, args.out / mode
        )
        row = window_row(mode, rec, args.warmup)
        rows.append({**row, "reward_workers": workers, "delay_s": delay, **fp})
        curves[mode] = rec.times
        print(f"{mode}: {row['seconds']:.1f} s for {row['steps_timed']} steps", file=sys.stderr)
    return rows, figures_of(rows), curves


def interleaved(args) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, list[float]]]:
    epoch = time.time()
    reward = reward_override(SLOW_S, args.period, epoch)
    workers, rec, fp = run_once(args.overrides, reward, args.steps, args.out / "interleaved")
    rows = [{**r, **fp} for r in turn_rows(rec, args.warmup, epoch, args.period, args.settle)]
    return rows, interleaved_figures(rows, workers), {"interleaved": rec.times}


def main() -> None:
    args = arguments()
    import ray

    start_ray()
    try:
        rows, figures, curves = (separate if args.separate else interleaved)(args)
    finally:
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "reward.csv", rows, fingerprint=run_fingerprint())
    plot(args.out, curves, args.warmup)
    cols = ["mode", "tokens_per_s", "seconds", "steps_timed", "learner_wait_frac",
            "staleness_mean", "reward_mean", "reward_errors"]  # fmt: skip
    if args.separate:
        cols.append("actor_idle_frac")
    else:
        cols.insert(1, "turn")
    print_table("reward latency vs throughput", cols, [[r[c] for c in cols] for r in rows])
    print(f"load (1/5/15 min): {os.getloadavg()}; outputs: {args.out}")
    emit_json(figures)


if __name__ == "__main__":
    main()
