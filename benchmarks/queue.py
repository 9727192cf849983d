"""Replay-queue throughput: trajectories of ~1k tokens per second through the
ReplayQueue, against raw ``ray.put`` / ``ray.get`` of the same objects, same run.

    queue mode:  producers ── acquire_many(c) ─ Outbox: queue.hand_over(c groups' metas)
                              ◀─ take_bundle: the bundle into the object store once, owned
                                 by the queue (the RolloutActor's hand-off, replay/outbox.py)
                 consumer ── queue.get_batch(bg, V) ──▶ resolve_groups (ray.get)
                              (staleness checks, accounting)
    raw mode:    producers ── ray.put(group) x c ─ consumer.push_many(refs) ──▶ a plain FIFO
                 consumer ── ray.get(refs)

Two producer actors stand in for rollout actors and one consumer for the learner
(a threaded actor that resolves refs with ``ray.get``, as the learner does). Every
group is labelled policy version 0 and the learner version rises by one per batch;
both modes hand refs over in chunks of ``c`` groups (``--chunk``, about what one
actor hands over per call in the default run), so the difference is what the queue
itself does;
the staleness bound is set beyond the run, so every check runs and nothing is
dropped. Rounds alternate the order (queue, raw, raw, queue, ...) so that other load on
the machine hits both alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import queue as stdlib_queue  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402
    actor_pid,
    cpu_seconds,
    emit_json,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    start_ray,
    write_csv,
)

PROMPT_TOKENS = 24
RESPONSE_TOKENS = 1000  # with the prompt: ~1k tokens per trajectory
UNREACHABLE_BOUND = 10**9  # staleness bound no run reaches: checks run, nothing drops


class Producer:
    """Holds ``n`` prebuilt trajectories and sends them as new groups (fresh ids)."""

    def __init__(self, name: str, n: int, seed: int):
        from asyncrl.trajectory import Trajectory

        rng = np.random.default_rng(seed)
        self.name = name
        self.outbox = None  # the current queue round's (replay/outbox.py)
        self.trajs = [
            Trajectory(
                traj_id=f"{name}-{i}",
                group_id="",
                prompt_ids=rng.integers(0, 100, PROMPT_TOKENS),
                response_ids=rng.integers(0, 100, RESPONSE_TOKENS),
                behaviour_logprobs=-rng.random(RESPONSE_TOKENS),
                versions=np.zeros(RESPONSE_TOKENS),
                loss_mask=np.ones(RESPONSE_TOKENS, dtype=bool),
                reward=float(rng.random()),
            )
            for i in range(n)
        ]

    def _group(self):
        from asyncrl.replay.buffer import GroupMeta
        from asyncrl.trajectory import TrajectoryGroup

        gid = f"{self.name}-{uuid.uuid4().hex[:12]}"
        meta = GroupMeta(
            group_id=gid,
            traj_ids=[f"{gid}-{i}" for i in range(len(self.trajs))],
            min_versions=[t.min_version for t in self.trajs],
            num_tokens=[t.num_tokens for t in self.trajs],
            rewards=[t.reward for t in self.trajs],
            actor=self.name,
        )
        return TrajectoryGroup(gid, self.trajs), meta

    async def take_bundle(self, key: int) -> tuple[int, list]:
        """The queue takes a hand-off's bundle, as from a RolloutActor."""
        return await self.outbox.take(key)

    async def feed_queue(self, queue: Any, num_groups: int, chunk: int) -> None:
        from asyncrl.replay.outbox import Outbox

        self.outbox = outbox = Outbox(queue)
        left = num_groups
        while left:
            granted = await queue.acquire_many.remote(min(chunk, left), 1.0)
            for _ in range(granted):
                outbox.put(*self._group())
            left -= granted
        await outbox.drain()
        if outbox.error:
            raise RuntimeError(outbox.error)

    async def feed_raw(self, sink: Any, num_groups: int, chunk: int) -> None:
        import ray

        left = num_groups
        while left:
            n = min(chunk, left)
            await sink.push_many.remote([[ray.put(self._group()[0])] for _ in range(n)])
            left -= n

    def nbytes(self) -> int:
        from asyncrl.trajectory import to_bytes

        return len(to_bytes(self.trajs))


class Consumer:
    """The learner's side: takes batches of refs and resolves them with ``ray.get``."""

    def __init__(self) -> None:
        self._refs: stdlib_queue.Queue = stdlib_queue.Queue()

    def push_many(self, ref_lists: list[list]) -> None:
        for ref_list in ref_lists:
            self._refs.put(ref_list[0])

    def take_queue(self, queue: Any, num_batches: int, batch_groups: int) -> int:
        import ray

        from asyncrl.replay.queue import resolve_groups

        n = 0
        for version in range(num_batches):
            items = ray.get(queue.get_batch.remote(batch_groups, version, 60.0))
            if not items:
                raise RuntimeError(f"no batch within 60 s at version {version}")
            groups = resolve_groups(items)  # what the learner does
            n += sum(len(g.trajectories) for g in groups)
        return n

    def take_raw(self, num_batches: int, batch_groups: int) -> int:
        import ray

        n = 0
        for _ in range(num_batches):
            refs = [self._refs.get(timeout=60) for _ in range(batch_groups)]
            n += sum(len(g.trajectories) for g in ray.get(refs))
        return n


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    return {f"cpu_{role}_s": sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}


def run_round(
    mode: str,
    producers: list,
    consumer: Any,
    batches: int,
    bg: int,
    pids: dict[str, list[int]],
    chunk: int,
    capacity_batches: int = 4,
) -> dict[str, Any]:
    """One timed pass; also the CPU seconds producers, consumer and queue used in it."""
    import ray

    from asyncrl.replay.queue import remote_queue

    per_producer = batches * bg // len(producers)
    queue = None
    if mode == "queue":
        queue = remote_queue(
            max_staleness=UNREACHABLE_BOUND,
            batch_groups=bg,
            policy="throttle",
            capacity_groups=capacity_batches * bg,
        )
        pids = dict(pids, queue=[actor_pid(queue)])  # the queue is up before the clock starts
        cpu0 = cpu_by_role(pids)
        t0 = time.perf_counter()
        feeds = [p.feed_queue.remote(queue, per_producer, chunk) for p in producers]
        taken = ray.get(consumer.take_queue.remote(queue, batches, bg))
    else:
        cpu0 = cpu_by_role(pids)
        t0 = time.perf_counter()
        feeds = [p.feed_raw.remote(consumer, per_producer, chunk) for p in producers]
        taken = ray.get(consumer.take_raw.remote(batches, bg))
    seconds = time.perf_counter() - t0
    ray.get(feeds)
    cpu1 = cpu_by_role(pids)
    row: dict[str, Any] = {"mode": mode, "trajectories": taken, "seconds": seconds}
    row["traj_per_s"] = taken / seconds
    row.update({k: cpu1[k] - cpu0[k] for k in cpu0})
    row.setdefault("cpu_queue_s", 0.0)
    if queue is not None:
        s = ray.get(queue.stats.remote())
        assert s["produced"] == s["trained"] + s["dropped_stale"] + s["in_flight"], s
        assert s["trained"] == taken and s["dropped_stale"] == 0, s
        row["max_staleness_seen"] = s["max_staleness_trained"]
        ray.kill(queue)
    return row


def arguments():
    p = parser("queue", __doc__)
    p.add_argument("--batches", type=int, default=None, help="batches per round")
    p.add_argument("--rounds", type=int, default=None, help="queue/raw round pairs")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per batch")
    p.add_argument("--n", type=int, default=8, help="trajectories per group")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument(
        "--capacity-batches",
        type=int,
        default=4,
        help="queue capacity in batches (4: what the default max_staleness=2 gives); "
        "producers wait when it is full, raw mode has no such bound",
    )
    p.add_argument("--chunk", type=int, default=16, help="groups per hand-off call")
    args = p.parse_args()
    args.batches = args.batches or (30 if args.quick else 200)
    args.rounds = args.rounds or (2 if args.quick else 6)
    if (args.batches * args.batch_groups) % args.producers:
        p.error("--batches x --batch-groups must divide among --producers")
    return args


def measure(args: Any) -> list[dict[str, Any]]:
    """Rounds of queue and raw mode, alternating which goes first, after a warm-up."""
    import ray

    bg, n = args.batch_groups, args.n
    producers = [
        ray.remote(Producer).options(num_cpus=0).remote(f"p{i}", n, i)
        for i in range(args.producers)
    ]
    consumer = ray.remote(Consumer).options(num_cpus=0, max_concurrency=4).remote()
    group_bytes = ray.get(producers[0].nbytes.remote())
    pids = {"producers": [actor_pid(p) for p in producers], "consumer": [actor_pid(consumer)]}
    # warm-up: worker processes, imports, object-store paths of both modes
    for mode in ("queue", "raw"):
        run_round(mode, producers, consumer, 2, bg, pids, args.chunk, args.capacity_batches)
    rows = []
    for r in range(args.rounds):
        for mode in ("queue", "raw") if r % 2 == 0 else ("raw", "queue"):
            row = run_round(
                mode, producers, consumer, args.batches, bg, pids, args.chunk,
                args.capacity_batches,
            )  # fmt: skip
            row.update(round=r, mb_per_s=row["traj_per_s"] * group_bytes / n / 1e6)
            rows.append(row)
    return rows


def plot(out: Path, rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, mode in enumerate(("queue", "raw")):
        vals = [r["traj_per_s"] for r in rows if r["mode"] == mode]
        ax.bar([j * 3 + i for j in range(len(vals))], vals, label=mode)
    ax.set_xlabel("round")
    ax.set_ylabel("trajectories / s")
    ax.set_title(
        f"ReplayQueue vs raw ray.put/get ({PROMPT_TOKENS + RESPONSE_TOKENS}-token trajectories)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "queue.png", dpi=120)


def main() -> None:
    args = arguments()
    import ray

    start_ray()
    try:
        rows = measure(args)
    finally:
        ray.shutdown()

    def total(mode: str) -> float:
        sel = [r for r in rows if r["mode"] == mode]
        return sum(r["trajectories"] for r in sel) / sum(r["seconds"] for r in sel)

    q, raw = total("queue"), total("raw")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "queue.csv", rows, fingerprint=run_fingerprint())
    plot(args.out, rows)
    print_table(
        f"replay queue vs raw ray.put/get: {args.producers} producers, 1 consumer, "
        f"{args.batch_groups} groups x {args.n} trajectories of "
        f"{PROMPT_TOKENS + RESPONSE_TOKENS} tokens per batch, {args.batches} batches per "
        f"round, hand-offs of {args.chunk} groups, queue capacity {args.capacity_batches} "
        f"batches, {args.rounds} round(s){' (--quick)' if args.quick else ''}",
        ["round", "mode", "trajectories", "seconds", "traj/s", "MB/s", "CPU s: producers",
         "consumer", "queue"],
        [
            [r["round"], r["mode"], r["trajectories"], r["seconds"], r["traj_per_s"],
             r["mb_per_s"], r["cpu_producers_s"], r["cpu_consumer_s"], r["cpu_queue_s"]]
            for r in rows
        ],
    )  # fmt: skip
    print(f"queue {q:.0f} traj/s, raw {raw:.0f} traj/s, ratio {q / raw:.3f}")
    print(f"outputs: {args.out}")
    emit_json({"queue_traj_per_s": q, "raw_traj_per_s": raw, "ratio": ratio(q, raw)})


if __name__ == "__main__":
    main()
