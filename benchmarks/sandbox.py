"""Sandbox throughput and containment: simple correct solutions graded through a
SandboxPool per second, against bare ``python -c pass`` spawns at the same concurrency,
same run; then every hostile program of ``asyncrl.sandbox.hostile`` through the pool.

    pool mode:  asyncio.gather(pool.grade(CORRECT, CASES) x n) ── workers threads ──▶
                unshare ─▶ harness ─▶ one forked child per case (2 cases)
    raw mode:   ThreadPoolExecutor(workers): subprocess.run([python, "-c", "pass"]) x n

Rounds alternate the order (pool, raw, raw, pool, ...) so that other load on the machine
hits both alike. A hostile program counts as contained when it scores 0, ends within its
time limit (plus start-up grace), leaves no process or file behind (checked again after
its daemons would have woken) and the next grading of a correct solution scores 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

from asyncrl.sandbox import SandboxPool, SandboxSettings  # noqa: E402
from asyncrl.sandbox.hostile import CASES, CORRECT, HOSTILE, check, leftovers, new_tag, program  # noqa: E402
from benchmarks.common import emit_json, parser, print_table, ratio, write_csv  # noqa: E402

DAEMON_WAKE_S = 1.5  # the detached daemon writes its file after 1 s if it survived


def pool_round(pool: SandboxPool, n: int) -> float:
    async def go() -> list:
        return await asyncio.gather(*(pool.grade(CORRECT, CASES) for _ in range(n)))

    t0 = time.perf_counter()
    grades = asyncio.run(go())
    seconds = time.perf_counter() - t0
    bad = [g.error for g in grades if g.reward != 1.0]
    if bad:
        raise RuntimeError(f"a correct solution did not score 1: {bad[0]}")
    return seconds


def raw_round(python: str, workers: int, n: int) -> float:
    def spawn(_: int) -> None:
        subprocess.run([python, "-c", "pass"], check=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(spawn, range(n)))
    return time.perf_counter() - t0


def hostile_rows(pool: SandboxPool, names: list[str]) -> list[dict[str, Any]]:
    rows, tags = [], {}
    for name in names:
        tag = new_tag()
        g = pool.grade_sync(program(name, tag), CASES)
        c = check(name, g, tag, pool.settings.timeout_s)
        after = pool.grade_sync(CORRECT, CASES)
        if after.reward != 1.0:
            c.reasons.append(f"next grading scored {after.reward}: {after.error}")
        tags[name] = (tag, g.run_id)
        rows.append({"name": name, "reward": g.reward, "wall_s": g.wall_s,
                     "reasons": c.reasons, "error": g.error[:120]})  # fmt: skip
    time.sleep(DAEMON_WAKE_S)
    for row in rows:
        row["reasons"] += leftovers(*tags[row["name"]])
        row["contained"] = not row["reasons"]
        row["reasons"] = "; ".join(row["reasons"])[:200]
    return rows


def main() -> None:
    p = parser("sandbox", __doc__)
    p.add_argument("--workers", type=int, default=2, help="sandboxes (and raw spawns) at once")
    p.add_argument("--execs", type=int, default=None, help="executions per round and mode")
    p.add_argument("--rounds", type=int, default=None, help="pool/raw round pairs")
    p.add_argument("--timeout", type=float, default=1.0, help="time limit of a hostile run")
    p.add_argument("--hostile", default="all", help="comma-separated names, or all")
    args = p.parse_args()
    n = args.execs or (40 if args.quick else 200)
    rounds = args.rounds or (2 if args.quick else 6)
    names = list(HOSTILE) if args.hostile == "all" else args.hostile.split(",")
    unknown = sorted(set(names) - set(HOSTILE))
    if unknown:
        p.error(f"unknown hostile program(s) {unknown}; known: {sorted(HOSTILE)}")

    settings = SandboxSettings.defaults(workers=args.workers, timeout_s=args.timeout)
    rows: list[dict[str, Any]] = []
    with SandboxPool(settings) as pool:
        python = pool_python(pool)
        pool_round(pool, args.workers)  # warm-up: page cache, the namespace probe
        raw_round(python, args.workers, args.workers)
        for r in range(rounds):
            for mode in ("pool", "raw") if r % 2 == 0 else ("raw", "pool"):
                s = pool_round(pool, n) if mode == "pool" else raw_round(python, args.workers, n)
                rows.append({"round": r, "mode": mode, "execs": n, "seconds": s,
                             "per_s": n / s})  # fmt: skip
        hostile = hostile_rows(pool, names)
        isolation = pool.isolation

    def total(mode: str) -> float:
        sel = [x for x in rows if x["mode"] == mode]
        return sum(x["execs"] for x in sel) / sum(x["seconds"] for x in sel)

    execs, raw = total("pool"), total("raw")
    contained = sum(h["contained"] for h in hostile)
    write_csv(args.out / "sandbox.csv", rows)
    write_csv(args.out / "sandbox_hostile.csv", hostile)
    print_table(
        f"sandbox pool vs bare `python -c pass`: {args.workers} at once, {n} per round, "
        f"{rounds} round pair(s), isolation {isolation}{' (--quick)' if args.quick else ''}",
        ["round", "mode", "execs", "seconds", "per s"],
        [[x["round"], x["mode"], x["execs"], x["seconds"], x["per_s"]] for x in rows],
    )
    print_table(
        f"hostile programs (time limit {args.timeout} s each)",
        ["program", "contained", "reward", "wall s", "error / what escaped"],
        [[h["name"], h["contained"], h["reward"], h["wall_s"], h["reasons"] or h["error"]]
         for h in hostile],
    )  # fmt: skip
    print(f"pool {execs:.1f} execs/s, raw {raw:.1f} spawns/s, ratio {ratio(execs, raw):.3f}; "
          f"hostile contained {contained}/{len(hostile)}")  # fmt: skip
    print(f"outputs: {args.out}")
    emit_json({"execs_per_s": execs, "raw_spawn_per_s": raw, "ratio": ratio(execs, raw),
               "hostile_contained": contained, "hostile_total": len(hostile),
               "isolation": isolation, "workers": args.workers})  # fmt: skip


def pool_python(pool: SandboxPool) -> str:
    from asyncrl.sandbox.isolation import detect

    return detect(pool.settings.isolation, pool.settings.python).python


if __name__ == "__main__":
    main()
