"""Actor throughput: generated tokens/s of one asyncrl RolloutActor (generation,
scoring, ``ray.put`` of each group and handing it to the replay queue) against plain
vLLM ``AsyncLLM.generate`` of the same prompts on the same engine, same run.

    asyncrl:  the actor's own loop: queue.acquire ─ generate(n) ─ score ─ ray.put ─
              queue.put, up to actor.max_inflight_groups prompts in flight; the clock
              stops when the queue holds all P groups
    vllm:     the same AsyncLLM, in the same process, with the actor's loop stopped:
              all P prompts submitted at once with the actor's SamplingParams (n
              samples each); the clock stops at the last completion
    vllm_capped: the same, with at most actor.max_inflight_groups prompts in flight
              (what the actor keeps): separates what the hand-off costs from what the
              in-flight cap costs (``ratio_vs_capped``)

One engine serves both sides (one start-up, no engine-to-engine variance): only
what the actor adds around ``generate`` differs. The task's answers are 2-3 tokens, so
the default measures per-group costs above all; ``--min-tokens N
actor.sampling.max_tokens=M`` makes every sample N to M tokens long on both sides, as
real completions are. By default (``--engine-cores auto``, on two or more cores) the
engine's processes run on the lowest usable core (here ``actor.engine_cores=0``) and
the actor's own process, where vLLM's frontend and all the actor's work run, on the
other cores (``--engine-cores os`` leaves every process to the OS, which on 2 cores
puts the actor's work on the engine's core part of the time: ``ratio`` 0.78-0.86
there, README): both sides use the same engine in the same placement, and every
other process of the run (Ray's, the queue's) runs off the engine's cores,
as in training (``wiring.keep_off_engines``). Measurements alternate (asyncrl, vllm,
vllm_capped, then reversed, ...) after an untimed warm-up of each side at full size
(``--warmup-prompts``): with a small warm-up the first measurement, always the
actor's, was the slowest of its run in 5 of 5 runs (8-15% under the next rounds);
whatever is paid once (which is not shown: memory first touched, caches) is now
paid before the clock, by neither side.
``ratio`` is over all rounds' tokens and seconds; ``ratio_per_round`` and
``ratio_median`` compare the sides within each round (this machine's throughput drifts
by 20-30% between minutes, so one round's outlier moves ``ratio`` by several points).
``engine_cpu_ms_per_token`` and ``engine_busy_cores`` (per side) are the engine
processes' CPU per generated token and their busy share of the wall time. They count
the worker's spin on vLLM's shared-memory queue between steps, so a core that reads
busy may still be waiting: on a saturated core the CPU per token only mirrors the
throughput. With a split placement the engine-core process's I/O threads run on the
actor's cores (``asyncrl.actor.placement.place_frontend``), so the engine's busy share can
exceed its cores.
``--io-threads-ab`` adds a fourth side, ``vllm_io_on_engine``: plain vLLM all at once
with those threads moved back onto the engine's cores for the measurement, to show
what that placement buys (``io_placement_gain`` = vllm / vllm_io_on_engine).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from asyncrl.actor.placement import move_engine_io  # noqa: E402
from asyncrl.engine.protocol import version_salt  # noqa: E402
from asyncrl.engine.vllm_engine import prompt_renderer, vllm_params  # noqa: E402
from benchmarks.common import (  # noqa: E402
    actor_pid,
    compose,
    cpu_seconds,
    emit_json,
    parser,
    print_table,
    process_tree,
    pyplot,
    ratio,
    run_fingerprint,
    start_ray,
    write_csv,
)
from tests.controlled_actor import ControlledRolloutActor  # noqa: E402

SIDES = ("asyncrl", "vllm", "vllm_capped")
IO_SIDE = "vllm_io_on_engine"  # --io-threads-ab
UNREACHABLE_BOUND = 10**9  # no learner here: versions never advance, nothing is stale


class BenchActor(ControlledRolloutActor):
    """The rollout actor, plus plain generation on its engine while its loop is halted."""

    def set_min_tokens(self, n: int) -> None:
        """Both sides generate at least ``n`` tokens per sample (vLLM's min_tokens: the
        stop tokens are masked until then), for responses longer than the task's."""
        from dataclasses import replace

        self.episodes.sampling = replace(self.episodes.sampling, min_tokens=n)

    def place_engine_io(self, on_engine: bool) -> int:
        """The engine-core process's threads other than its main one onto the engine's
        cores (``on_engine``) or back onto the actor's, where ``place_frontend`` put
        them. Returns how many threads moved."""
        cores = set(self.placement["engine_cores" if on_engine else "frontend_cores"])
        return move_engine_io(cores, self.core_io_threads)

    async def plain_generate(
        self, prompts: list[str], tag: str, inflight: int = 0
    ) -> dict[str, int]:
        # vLLM's own requests, on the engine's AsyncLLM: exactly the sampling the actor's
        # groups use (unseeded), rendered and salted as the actor's are
        llm = self.engine.llm
        params = vllm_params(self.episodes.sampling)
        render = prompt_renderer(llm)
        gate = asyncio.Semaphore(inflight or len(prompts))

        async def one(i: int, prompt: str):
            final = None
            async with gate:
                request = render(prompt, version_salt(self.version))
                async for out in llm.generate(request, params, request_id=f"{tag}-{i}"):
                    final = out
            return final

        finals = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return {
            "tokens": sum(len(c.token_ids) for f in finals for c in f.outputs),
            "trajectories": sum(len(f.outputs) for f in finals),
        }


class CpuMeter:
    """CPU seconds used during a measurement by the actor's own process (the Ray
    actor: its event loop, vLLM's output handling, scoring, ray.put), by vLLM's
    engine processes below it, and by the replay queue's process."""

    def __init__(self, actor_pid: int):
        self.actor_pid = actor_pid
        self.engine_pids = [p for p in process_tree(actor_pid) if p != actor_pid]

    def read(self, queue_pid: int | None) -> dict[str, float]:
        return {
            "cpu_actor_s": cpu_seconds(self.actor_pid),
            "cpu_engine_s": sum(cpu_seconds(p) for p in self.engine_pids),
            "cpu_queue_s": cpu_seconds(queue_pid) if queue_pid else 0.0,
        }

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: after[k] - before[k] for k in before}


def measure_asyncrl(actor: Any, seed: int, num_prompts: int, meter: CpuMeter) -> dict[str, Any]:
    import ray

    from asyncrl.replay.queue import remote_queue, resolve_groups

    # capacity = P groups: the actor starts P and then waits on the queue
    queue = remote_queue(
        max_staleness=UNREACHABLE_BOUND, batch_groups=1, policy="drop", capacity_groups=num_prompts
    )
    try:
        queue_pid = actor_pid(queue)  # the queue actor is up before the clock starts
        ray.get(actor.rebind.remote(queue, seed))  # the same prompts as the plain side
        cpu0 = meter.read(queue_pid)
        t0 = time.perf_counter()
        ray.get(actor.resume.remote())
        items = ray.get(queue.get_batch.remote(num_prompts, 0, 600.0))  # at the P-th put
        seconds = time.perf_counter() - t0
        cpu = meter.delta(cpu0, meter.read(queue_pid))
        ray.get(actor.halt.remote())  # cancels the groups started after the take
        if not items:
            raise RuntimeError(f"the actor did not produce {num_prompts} groups within 600 s")
        stats = ray.get(actor.get_stats.remote())
        if stats["fatal"]:
            raise RuntimeError(f"actor failed: {stats['fatal']}")
        groups = resolve_groups(items)
        return {
            "tokens": sum(len(t.response_ids) for g in groups for t in g.trajectories),
            "trajectories": sum(len(g.trajectories) for g in groups),
            "seconds": seconds,
            **cpu,
            # queue calls of the actor's own (in this measurement, a few more may follow
            # the take): hand-offs, and the loop's waiting slot requests
            "handoff_calls": stats["handoff_calls"],
            "acquire_calls": stats["acquire_calls"],
        }
    finally:
        ray.kill(queue)


def measure_vllm(
    actor: Any, prompts: list[str], tag: str, meter: CpuMeter, inflight: int = 0
) -> dict[str, Any]:
    import ray

    cpu0 = meter.read(None)
    t0 = time.perf_counter()
    out = ray.get(actor.plain_generate.remote(prompts, tag, inflight))
    out["seconds"] = time.perf_counter() - t0
    out.update(meter.delta(cpu0, meter.read(None)))
    return out


def start_actor(cfg: Any, setup: Any):
    """The actor with its engine up, its loop halted."""
    import ray

    from asyncrl.actor.launch import new_actor
    from asyncrl.replay.queue import remote_queue

    parking = remote_queue(max_staleness=0, batch_groups=0)  # never grants a slot
    actor = new_actor(
        setup.actor, setup.model_path, setup.task, parking, "actor0", cfg.seed, cls=BenchActor
    )
    ray.get(actor.start.remote())
    ray.get(actor.halt.remote())
    ray.kill(parking)
    return actor


def auto_engine_cores(flag: str, configured: Any) -> Any:
    """``--engine-cores``: ``os`` -> None (the OS places every process); ``auto`` -> the
    config's ``actor.engine_cores`` if set, else the lowest core this process may use
    when it may use two or more (the engine alone there, the actor's process and
    vLLM's frontend beside it), else None; anything else is the CPU list itself."""
    if flag == "os":
        return None
    if flag != "auto":
        return flag
    if configured is not None:
        return configured
    allowed = sorted(os.sched_getaffinity(0))
    return str(allowed[0]) if len(allowed) >= 2 else None


def arguments():
    p = parser("actor", __doc__)
    p.add_argument("--prompts", type=int, default=None, help="prompts (groups) per measurement")
    p.add_argument("--rounds", type=int, default=None, help="asyncrl/vllm measurement pairs")
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=None,
        metavar="N",
        help="prompts of the untimed warm-up of each side (default: --prompts; 0: none)",
    )
    p.add_argument(
        "--engine-cores",
        default="auto",
        metavar="LIST",
        help="actor.engine_cores: the engine's processes on these cores (e.g. 0), the "
        "actor's own process on the others; 'os': the OS places them; default 'auto': the "
        "config's if set, else the lowest usable core when there are two or more",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="every sample generates at least this many tokens, on both sides (longer "
        "responses than the task's 2-3 tokens; with actor.sampling.max_tokens=N)",
    )
    p.add_argument(
        "--io-threads-ab",
        action="store_true",
        help="add the side vllm_io_on_engine: plain vLLM with the engine-core process's "
        "I/O threads on the engine's cores, as before they moved (needs --engine-cores)",
    )
    p.add_argument(
        "overrides", nargs="*", help="training-config overrides, e.g. actor.sampling.n=4"
    )
    args = p.parse_args()
    args.num_prompts = args.prompts or (256 if args.quick else 1024)
    args.num_rounds = args.rounds or (2 if args.quick else 6)
    args.sides = SIDES + ((IO_SIDE,) if args.io_threads_ab else ())
    if args.warmup_prompts is not None and not 0 <= args.warmup_prompts <= args.num_prompts:
        p.error(f"--warmup-prompts must be in [0, --prompts={args.num_prompts}]")
    cfg = compose(*args.overrides)
    cores = auto_engine_cores(args.engine_cores, cfg.actor.engine_cores)
    if cores != cfg.actor.engine_cores:
        cores = "null" if cores is None else repr(cores)
        cfg = compose(*args.overrides, f"actor.engine_cores={cores}")
    if args.io_threads_ab and cfg.actor.engine_cores is None:
        p.error(
            "--io-threads-ab compares placements of a split engine: give --engine-cores "
            "(it has no split on one core or with --engine-cores os)"
        )
    return args, cfg


def measure_rounds(actor: Any, cfg: Any, args: Any, prompts: list[str]) -> list[dict]:
    """The untimed warm-up of each side, then the rounds, sides alternating."""
    import ray

    meter = CpuMeter(actor_pid(actor))
    # first use of each side's path, of the engine's memory and the queue's process,
    # untimed
    warm = args.num_prompts if args.warmup_prompts is None else args.warmup_prompts
    if warm:
        measure_vllm(actor, prompts[:warm], "warmup", meter)
        measure_asyncrl(actor, cfg.seed, warm, meter)
    cap = cfg.actor.max_inflight_groups
    rows = []
    for r in range(args.num_rounds):
        order = args.sides if r % 2 == 0 else args.sides[::-1]
        for side in order:
            if side == "asyncrl":
                out = measure_asyncrl(actor, cfg.seed, args.num_prompts, meter)
            elif side == IO_SIDE:
                if not ray.get(actor.place_engine_io.remote(True)):
                    raise RuntimeError("--io-threads-ab: no engine-core I/O thread moved")
                try:
                    out = measure_vllm(actor, prompts, f"r{r}{side}", meter)
                finally:
                    ray.get(actor.place_engine_io.remote(False))
            else:
                inflight = cap if side == "vllm_capped" else 0
                out = measure_vllm(actor, prompts, f"r{r}{side}", meter, inflight)
            out.update(round=r, side=side, tokens_per_s=out["tokens"] / out["seconds"])
            rows.append(out)
            print(f"round {r} {side}: {out['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    return rows


def run(cfg: Any, setup: Any, args: Any, prompts: list[str]) -> tuple[list[dict], dict]:
    """One actor on its own Ray: the rows of every measurement, and its placement."""
    import ray

    from asyncrl.wiring import keep_off_engines

    start_ray()
    actor = None
    try:
        actor = start_actor(cfg, setup)
        placement = ray.get(actor.get_stats.remote())["placement"]
        if placement:  # the engine's cores are its alone, as in training (wiring.py)
            placement["others_moved_threads"] = len(keep_off_engines([placement]))
        ray.get(actor.set_min_tokens.remote(args.min_tokens))
        return measure_rounds(actor, cfg, args, prompts), placement
    finally:
        if actor is not None:
            ray.get(actor.stop.remote())
            ray.kill(actor)
        ray.shutdown()


class Summary:
    """The rows, side by side: tokens/s per side, per round, and the engine's CPU."""

    def __init__(self, rows: list[dict], sides: tuple[str, ...], rounds: int):
        self.rows, self.sides, self.rounds = rows, sides, rounds
        self.by = {(x["round"], x["side"]): x["tokens_per_s"] for x in rows}

    def rate(self, side: str) -> float:
        sel = [x for x in self.rows if x["side"] == side]
        return sum(x["tokens"] for x in sel) / sum(x["seconds"] for x in sel)

    def round_ratios(self, side: str, other: str) -> list[float]:
        """``side`` / ``other`` within each round: measured minutes apart at most, so
        the machine's slow drifts cancel (the spread shows how noisy it was)."""
        return [self.by[(r, side)] / self.by[(r, other)] for r in range(self.rounds)]

    def engine_use(self, side: str) -> tuple[float, float]:
        """The engine's processes' CPU per generated token (ms) and their busy share of
        the side's wall time (cores), the worker's spin between steps included."""
        sel = [x for x in self.rows if x["side"] == side]
        cpu = sum(x["cpu_engine_s"] for x in sel)
        return 1000 * cpu / sum(x["tokens"] for x in sel), cpu / sum(x["seconds"] for x in sel)


def plot(rows: list[dict], sides: tuple[str, ...], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, side in enumerate(sides):
        vals = [x["tokens_per_s"] for x in rows if x["side"] == side]
        ax.bar([j * (len(sides) + 1) + i for j in range(len(vals))], vals, label=side)
    ax.set_xlabel("round")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("one RolloutActor vs plain vLLM generate, same engine and prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "actor.png", dpi=120)


def io_placement(sm: Summary) -> dict[str, Any]:
    """--io-threads-ab: plain vLLM with the engine-core I/O threads off / on the
    engine's cores."""
    v, vi = sm.rate("vllm"), sm.rate(IO_SIDE)
    io = {
        "vllm_io_on_engine_tokens_per_s": vi,
        "io_placement_gain": ratio(v, vi),
        "io_placement_gain_per_round": sm.round_ratios("vllm", IO_SIDE),
    }
    print(
        f"plain vLLM with the engine-core I/O threads on the engine's cores: {vi:.0f} "
        f"tokens/s; on the actor's cores (the actor's placement) {v:.0f}: gain "
        + ", ".join(f"{x:.3f}" for x in io["io_placement_gain_per_round"])
        + f" by round, {io['io_placement_gain']:.3f} over all"
    )
    return io


def report(cfg: Any, args: Any, rows: list[dict], placement: dict) -> None:
    sm = Summary(rows, args.sides, args.num_rounds)
    a, v, vc = sm.rate("asyncrl"), sm.rate("vllm"), sm.rate("vllm_capped")
    per_round = sm.round_ratios("asyncrl", "vllm")
    engine = {side: sm.engine_use(side) for side in args.sides}
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "actor.csv", rows, fingerprint=args.fingerprint)
    plot(rows, args.sides, args.out)
    s = cfg.actor.sampling
    print_table(
        f"RolloutActor vs plain AsyncLLM.generate on the same engine: {args.num_prompts} prompts "
        f"x n={s.n}, max_tokens={s.max_tokens}, min_tokens={args.min_tokens}, temperature {s.temperature}, engine {dict(cfg.actor.engine)}, "
        f"actor.engine_cores {cfg.actor.engine_cores} (placement {placement or 'by the OS'}), "
        f"{args.num_rounds} round(s){' (--quick)' if args.quick else ''}",
        ["round", "side", "trajectories", "tokens", "seconds", "tokens/s", "CPU s: actor proc",
         "engine procs", "queue"],
        [
            [x["round"], x["side"], x["trajectories"], x["tokens"], x["seconds"],
             x["tokens_per_s"], x["cpu_actor_s"], x["cpu_engine_s"], x["cpu_queue_s"]]
            for x in rows
        ],
    )  # fmt: skip
    print(f"asyncrl actor {a:.0f} tokens/s, plain vLLM {v:.0f} tokens/s, ratio {a / v:.3f}")
    print(
        f"plain vLLM with at most actor.max_inflight_groups={cfg.actor.max_inflight_groups} "
        f"prompts in flight, as the actor keeps: {vc:.0f} tokens/s, ratio {a / vc:.3f}"
    )
    print(
        "ratio within each round: "
        + ", ".join(f"{x:.3f}" for x in per_round)
        + f" (median {statistics.median(per_round):.3f})"
    )
    print(
        "engine processes, CPU ms per token (busy cores): "
        + ", ".join(f"{side} {ms:.3f} ({busy:.2f})" for side, (ms, busy) in engine.items())
    )
    io = io_placement(sm) if args.io_threads_ab else {}
    print(f"outputs: {args.out}")
    emit_json(
        {
            "actor_tokens_per_s": a,
            "vllm_tokens_per_s": v,
            "ratio": ratio(a, v),
            "vllm_capped_tokens_per_s": vc,
            "ratio_vs_capped": ratio(a, vc),
            "ratio_per_round": per_round,
            "ratio_median": statistics.median(per_round),
            "ratio_vs_capped_median": statistics.median(sm.round_ratios("asyncrl", "vllm_capped")),
            "placement": placement,
            "engine_cpu_ms_per_token": {side: ms for side, (ms, _) in engine.items()},
            "engine_busy_cores": {side: busy for side, (_, busy) in engine.items()},
            **io,
        }
    )


def main() -> None:
    from asyncrl.tasks.base import TaskSampler
    from asyncrl.wiring import prepare

    args, cfg = arguments()
    setup = prepare(cfg)  # builds the tiny model once if it is not cached
    args.fingerprint = run_fingerprint(cfg, setup.model_path, cfg.seed)
    sampler = TaskSampler(setup.task, cfg.seed)  # the RolloutActor draws the same prompts
    prompts = [sampler.next().text for _ in range(args.num_prompts)]
    rows, placement = run(cfg, setup, args, prompts)
    report(cfg, args, rows, placement)


if __name__ == "__main__":
    main()
