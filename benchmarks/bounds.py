"""Fixed staleness bounds against one that steers itself: the default training job
(or any overrides) run once per ``--bounds`` value, side by side.

    for bound in --bounds (default 2 8 auto):
        replay.max_staleness=<bound> ─▶ the training loop (asyncrl.loop.run_loop),
        --steps learner steps from fresh parts; the clock starts after --warmup steps

Per bound: seconds and response tokens trained per second over the timed steps, the
mean reward of the last 10% of the steps, the largest staleness trained, samples
dropped as stale, and (auto) the bound at the end, its highest and how often it moved.
Nothing is pinned: the parts share the machine's cores as the training job does. The
last stdout line is one JSON object: ``by_bound`` (one entry per bound) and the host.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import time  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Recorder,
    compose,
    emit_json,
    host,
    parser,
    print_table,
    run_fingerprint,
    start_ray,
    stop_all,
    write_csv,
)

LAST_SHARE = 0.1  # the reward figure: the mean over the last tenth of the steps


class TimedRecorder(Recorder):
    """Every step's metrics and the wall time it was logged at."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        self.times.append(time.time())


def run_bound(bound: str, overrides: list[str], steps: int, warmup: int, out: Path) -> dict:
    from asyncrl.loop import run_loop
    from asyncrl.wiring import prepare, start_parts

    cfg = compose(*overrides, f"replay.max_staleness={bound}", f"max_steps={steps}",
                  "progress=false")  # fmt: skip
    setup = prepare(cfg)
    out.mkdir(parents=True, exist_ok=True)
    parts = start_parts(setup, out, started_ray=False)
    rec = TimedRecorder()
    try:
        run_loop(cfg, parts, rec)
    finally:
        q, _ = stop_all(parts)
    window = rec.times[-1] - rec.times[warmup - 1]
    timed = rec.steps[warmup:]
    last = rec.steps[-max(1, round(LAST_SHARE * len(rec.steps))) :]
    count = sum(s["reward/count"] for s in last)
    return {
        "bound": bound,
        "steps_timed": len(timed),
        "seconds": window,
        "tokens_per_s": sum(s["tokens/trained"] for s in timed) / window,
        "samples_per_s": sum(s["reward/count"] for s in timed) / window,
        "reward_last": sum(s["reward/sum"] for s in last) / count if count else float("nan"),
        "max_staleness_trained": q["max_staleness_trained"],
        "dropped_stale": q["dropped_stale"],
        "bound_final": q["max_staleness"],
        "bound_highest": q["highest_bound"],
        "bound_changes": q["bound_changes"],
        "accounted": q["produced"] == q["trained"] + q["dropped_stale"] + q["in_flight"],
        "bound_by_step": [int(s["replay/bound"]) for s in rec.steps],
    }


def arguments():
    p = parser("bounds", __doc__)
    p.add_argument("--bounds", nargs="+", default=["2", "8", "auto"],
                   help="replay.max_staleness values, run in turn")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="learner steps per bound")
    p.add_argument("--warmup", type=int, default=None, help="steps before the clock starts")
    p.add_argument("overrides", nargs="*", help="training-config overrides for every bound")
    args = p.parse_args()
    args.steps = args.steps or (40 if args.quick else 300)
    args.warmup = args.warmup or (5 if args.quick else 10)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    for b in args.bounds:
        if b != "auto" and not (b.isdigit()):
            p.error(f"--bounds: {b!r} is neither an integer >= 0 nor auto")
    compose(*args.overrides, f"replay.max_staleness={args.bounds[0]}")  # a bad override: now
    return args


def main() -> None:
    args = arguments()
    import ray

    start_ray()
    rows = []
    try:
        for b in args.bounds:
            rows.append(run_bound(b, args.overrides, args.steps, args.warmup, args.out / b))
            print(f"bound {b}: {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    finally:
        ray.shutdown()
    write_csv(args.out / "bounds.csv", [{k: v for k, v in r.items() if k != "bound_by_step"}
                                        for r in rows], fingerprint=run_fingerprint())  # fmt: skip
    print_table(
        f"staleness bounds: {args.steps} steps each ({args.warmup} warm-up, untimed)"
        f"{' (--quick)' if args.quick else ''}",
        ["bound", "seconds", "tokens/s", "samples/s", "reward (last 10%)", "max stale",
         "dropped", "final", "highest", "changes", "accounted"],
        [[r["bound"], r["seconds"], r["tokens_per_s"], r["samples_per_s"], r["reward_last"],
          r["max_staleness_trained"], r["dropped_stale"], r["bound_final"], r["bound_highest"],
          r["bound_changes"], r["accounted"]] for r in rows],
    )  # fmt: skip
    emit_json(
        {
            "by_bound": {r["bound"]: {k: v for k, v in r.items() if k != "bound"} for r in rows},
            "steps": args.steps,
            "warmup": args.warmup,
            "host": host(),
        }
    )


if __name__ == "__main__":
    main()
