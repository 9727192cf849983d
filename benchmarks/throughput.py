"""What asynchrony buys: the same samples, model and task, trained two ways, with the
actor pinned to core 0 and the learner to core 1 in both.

    sync:   window opens ─▶ actor generates one batch ─▶ learner trains on it ─▶
            weights to the actor (waited for) ─▶ window opens ...   (replay.max_staleness=0
            and the loop's wait_for_sync hook: nothing is generated with old weights)
    async:  the training job's loop (asyncrl.loop.run_loop): the actor runs ahead within
            replay.max_staleness while the learner trains; weight syncs are not waited for

Both modes run ``--steps`` learner steps from fresh parts; the clock covers the
steps after the first ``--warmup`` (the pipeline is full by then, and the batches
generated while the parts started up are used up), so both time the same number
of samples in steady state. From the sync run's phases:

    generation = window open -> batch ready, plus the weight load (the actor does it)
    training   = learner.train_step
    ideal_speedup = (generation + training) / max(generation, training)
    efficiency    = speedup / ideal_speedup

In the async run: actor_idle_frac = share of the window with no group in flight
(sampled every 50 ms), learner_idle_frac = share not inside ``train_step``,
tokens_per_s = response tokens trained per second.

Pinning: every thread of the actor's process tree (the Ray actor, vLLM's engine core
and worker) goes to core 0 and vLLM's OpenMP threads bind there
(``VLLM_CPU_OMP_THREADS_BIND=0``); every thread of the learner's process goes to
core 1 with one torch thread. Ray's own processes, the queue and the driver float.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import math  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Recorder,
    actor_pid,
    compose,
    emit_json,
    fingerprint_columns,
    parser,
    pin_tree,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    start_ray,
    stop_all,
    write_csv,
)

ACTOR_CORE, LEARNER_CORE = 0, 1
IDLE_SAMPLE_S = 0.05  # how often the actor's in-flight count is sampled (a cheap RPC)


class WindowRecorder(Recorder):
    """Records every step's metrics and wall time; between the end of step ``warmup``
    and the last step it samples whether the actor has any group in flight."""

    def __init__(self, parts: Any, warmup: int, steps: int) -> None:
        super().__init__()
        self.parts, self.warmup, self.total = parts, warmup, steps
        self.times: list[float] = []
        self.idle_samples: list[bool] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        self.times.append(time.perf_counter())
        if len(self.times) == self.warmup:
            self._sampler.start()
        if len(self.times) == self.total:
            self._stop.set()
            self._sampler.join()

    def _sample(self) -> None:
        """Actor idle = no group in flight (``inflight == 0``), sampled over the
        measured window only (the actor's own ``idle_seconds`` counts from its start,
        engine warm-up included)."""
        import ray

        actors = list(self.parts.actors.values())
        while not self._stop.wait(IDLE_SAMPLE_S):
            stats = ray.get([a.get_stats.remote() for a in actors])
            self.idle_samples.append(all(s["inflight"] == 0 for s in stats))

    @property
    def actor_idle_frac(self) -> float:
        return sum(self.idle_samples) / len(self.idle_samples) if self.idle_samples else math.nan


def pin_parts(parts: Any) -> dict[str, int]:
    """Actor process tree -> ACTOR_CORE, learner process -> LEARNER_CORE."""
    threads = {}
    for name, a in parts.actors.items():
        threads[name] = pin_tree(actor_pid(a), {ACTOR_CORE})
    ranks = getattr(parts.learner, "ranks", [parts.learner])  # a LearnerGroup or one actor
    threads["learner"] = sum(pin_tree(actor_pid(r), {LEARNER_CORE}) for r in ranks)
    return threads


# The loop's per-step phase times (asyncrl.loop) as this benchmark names them.
PHASES = {"generate": "perf/wait_seconds", "train": "perf/train_seconds",
          "weight_sync": "perf/publish_seconds"}  # fmt: skip


def run_mode(mode: str, overrides: list[str], steps: int, warmup: int, pin: bool, out: Path):
    import ray

    from asyncrl.loop import LoopHooks, run_loop
    from asyncrl.wiring import prepare, start_parts

    staleness = ["replay.max_staleness=0"] if mode == "sync" else []
    cfg = compose(*overrides, *staleness, f"max_steps={steps}", "progress=false")
    setup = prepare(cfg)
    fp = fingerprint_columns(run_fingerprint(cfg, setup.model_path, cfg.seed))
    out.mkdir(parents=True, exist_ok=True)
    parts = start_parts(setup, out, started_ray=False)
    try:
        threads = pin_parts(parts) if pin else {}
        rec = WindowRecorder(parts, warmup, steps)
        # sync: generate a batch, train on it, hand the weights over (waited for), repeat
        run_loop(cfg, parts, rec, hooks=LoopHooks(wait_for_sync=mode == "sync"))
        q = ray.get(parts.queue.stats.remote())
    finally:
        stop_all(parts)
    window = rec.times[-1] - rec.times[warmup - 1]
    measured = rec.steps[warmup:]
    # phases of the synchronous loop, over the measured window
    phases = {k: sum(s[m] for s in measured) for k, m in PHASES.items()} if mode == "sync" else {}
    tokens = sum(s["tokens/trained"] for s in measured)
    busy = sum(s["perf/learner_step_seconds"] for s in measured)
    row = {
        "mode": mode,
        "steps_timed": len(measured),
        "samples_timed": int(sum(s["reward/count"] for s in measured)),
        "seconds": window,
        "tokens_per_s": tokens / window,
        "actor_idle_frac": rec.actor_idle_frac,
        "learner_idle_frac": 1 - busy / window,
        "dropped_stale": q["dropped_stale"],
        "max_staleness": q["max_staleness_trained"],
        "reward_last": measured[-1]["reward/mean"],
        "threads_pinned": sum(threads.values()),
        **{f"{k}_seconds": v for k, v in phases.items()},
        **fp,
    }
    return row, rec


def arguments():
    p = parser("throughput", __doc__)
    p.add_argument("--steps", type=int, default=None, help="learner steps per mode")
    p.add_argument("--warmup", type=int, default=None, help="steps before the clock starts")
    p.add_argument("--no-pin", action="store_true", help="let the OS place actor and learner")
    p.add_argument("overrides", nargs="*", help="training-config overrides for both modes")
    args = p.parse_args()
    args.steps = args.steps or (30 if args.quick else 200)
    args.warmup = args.warmup or (5 if args.quick else 10)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    args.pin = not args.no_pin
    if args.pin and not {ACTOR_CORE, LEARNER_CORE} <= os.sched_getaffinity(0):
        p.error(f"pinning needs cores {ACTOR_CORE} and {LEARNER_CORE}; use --no-pin")
    return args


def figures_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The JSON figures from the two modes' rows (sync first)."""
    sync, asyn = rows
    gen = sync["generate_seconds"] + sync["weight_sync_seconds"]
    train = sync["train_seconds"]
    speedup = ratio(sync["seconds"], asyn["seconds"])
    ideal = ratio(gen + train, max(gen, train))
    return {
        "sync_seconds": sync["seconds"],
        "async_seconds": asyn["seconds"],
        "speedup": speedup,
        "ideal_speedup": ideal,
        "efficiency": ratio(speedup, ideal),
        "actor_idle_frac": asyn["actor_idle_frac"],
        "learner_idle_frac": asyn["learner_idle_frac"],
        "tokens_per_s": asyn["tokens_per_s"],
    }


def plot(out: Path, curves: dict[str, list[float]], warmup: int, figures: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, times in curves.items():
        t0 = times[warmup - 1]
        ax.plot([t - t0 for t in times[warmup - 1 :]], range(len(times) - warmup + 1), label=mode)
    ax.set_xlabel("seconds since the clock started")
    ax.set_ylabel("learner steps")
    ax.set_title(
        f"sync vs async, same samples (speedup {figures['speedup']:.2f}x, "
        f"ideal {figures['ideal_speedup']:.2f}x)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def report(args: Any, rows: list[dict[str, Any]], figures: dict[str, float]) -> None:
    c = compose(*args.overrides)
    print_table(
        f"sync vs async: {args.steps} steps per mode ({args.warmup} warm-up, untimed), "
        f"{c.learner.batch_groups} groups x n={c.actor.sampling.n} per step, "
        f"max_staleness {c.replay.max_staleness} (async) / 0 (sync), "
        f"{'actor on core 0, learner on core 1' if args.pin else 'unpinned'}"
        f"{' (--quick)' if args.quick else ''}",
        ["mode", "seconds", "tokens/s", "gen s", "train s", "sync s", "actor idle", "learner idle",
         "dropped", "max stale"],
        [
            [r["mode"], r["seconds"], r["tokens_per_s"], r.get("generate_seconds", "-"),
             r.get("train_seconds", "-"), r.get("weight_sync_seconds", "-"),
             r["actor_idle_frac"], r["learner_idle_frac"], r["dropped_stale"], r["max_staleness"]]
            for r in rows
        ],
    )  # fmt: skip
    sync = rows[0]
    gen = sync["generate_seconds"] + sync["weight_sync_seconds"]
    print(
        f"speedup {figures['speedup']:.2f}x, ideal {figures['ideal_speedup']:.2f}x "
        f"(generation+weight load {gen:.1f} s, training {sync['train_seconds']:.1f} s in "
        f"sync), efficiency {figures['efficiency']:.2f}"
    )
    print(f"outputs: {args.out}")


def main() -> None:
    args = arguments()
    import ray

    # vLLM's OpenMP threads: one, bound to the actor's core (its default spreads them)
    start_ray(env={"VLLM_CPU_OMP_THREADS_BIND": str(ACTOR_CORE)} if args.pin else None)
    rows, curves = [], {}
    try:
        for mode in ("sync", "async"):
            row, rec = run_mode(
                mode, args.overrides, args.steps, args.warmup, args.pin, args.out / mode
            )
            rows.append(row)
            curves[mode] = rec.times
            print(f"{mode}: {row['seconds']:.1f} s for {row['steps_timed']} steps", file=sys.stderr)
    finally:
        ray.shutdown()
    figures = figures_of(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "throughput.csv", rows, fingerprint=run_fingerprint())
    plot(args.out, curves, args.warmup, figures)
    report(args, rows, figures)
    emit_json(figures)


if __name__ == "__main__":
    main()
