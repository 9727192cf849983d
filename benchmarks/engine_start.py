"""Engine start-up: how long a vLLM-CPU engine takes from a fresh process to its first
request, and how fast it then generates, three ways side by side: ``forked``, its one
worker inside the engine-core process (``actor.engine.in_core_worker=true``,
asyncrl/engine/in_core.py) and that process forked from a fork server that is itself
forked first thing from this process, as the actor does (``actor.engine.forkserver=true``,
asyncrl/engine/launcher.py: the defaults); ``in_core``, the same process spawned fresh (``forkserver=false``);
``separate``, the worker in a process of its own (``in_core_worker=false``: vLLM's
multiprocess executor).

Each measurement is a fresh Python process (``--child``), as an actor's is: its clock
starts at the process's first line, so torch's and vLLM's imports count, and stops
when ``make_engine`` returns (``start_seconds``); then the same fixed batch (16
prompts x 8 samples x exactly 32 tokens) is generated ``--batches`` times
after one untimed batch (``tokens_per_s``). The sides alternate, in this order in odd
rounds and reversed in even ones. ``start_ratio`` = separate / in-core start (> 1:
in-core starts sooner); ``generation_ratio`` = in-core / separate tokens/s (1: no
cost); ``fork_start_ratio`` = in-core / forked start, ``fork_generation_ratio`` =
forked / in-core tokens/s; ``engine_pss_mb_<side>``: the memory the engine's processes
(and the fork server) add, PSS while the engine is up. Medians over rounds. Not in a Ray actor (the actor adds its own process and
imports to both sides alike).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

T0 = time.monotonic()

from benchmarks.common import (  # noqa: E402
    ROOT,
    emit_json,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    write_csv,
)

SIDES = ("forked", "in_core", "separate")
PROMPTS, SAMPLES, TOKENS = 16, 8, 32


def child(side: str, batches: int) -> dict:
    """One engine start and its generation, in this (fresh) process."""
    import asyncio

    from asyncrl.engine import launcher
    from asyncrl.engine.settings import EngineSettings
    from asyncrl.engine.vllm_engine import make_engine

    settings = EngineSettings.defaults(
        in_core_worker=side != "separate", forkserver=side == "forked"
    )
    if side == "forked":  # first thing in this fresh process, as the actor does
        launcher.warm()
    from asyncrl.engine.protocol import Sampling
    from asyncrl.models.tiny import default_spec, ensure_tiny_model
    from asyncrl.tasks.arithmetic import AdditionTask

    path = ensure_tiny_model(AdditionTask(max_operand=19), default_spec())
    engine = make_engine(str(path), settings, seed=0)
    started = time.monotonic() - T0
    sampling = Sampling(n=SAMPLES, temperature=1.0, max_tokens=TOKENS, min_tokens=TOKENS)

    async def batch(tag: str) -> tuple[float, int]:
        t = time.monotonic()
        outs = await asyncio.gather(
            *(
                engine.generate([1, 2, 3, 4, 5 + i % 7], sampling, f"{tag}-{i}")
                for i in range(PROMPTS)
            )
        )
        return time.monotonic() - t, sum(len(c.token_ids) for g in outs for c in g.completions)

    async def run() -> list[tuple[float, int]]:
        await batch("warm")
        return [await batch(f"b{k}") for k in range(batches)]

    timed = asyncio.run(run())
    memory = engine_pss_mb()
    engine.shutdown()
    seconds, tokens = sum(t for t, _ in timed), sum(n for _, n in timed)
    return {"side": side, "start_seconds": started, "tokens_per_s": tokens / seconds,
            "engine_pss_mb": memory}  # fmt: skip


def engine_pss_mb() -> float:
    """Proportional memory (PSS, MB) of this process's descendants: the engine's
    processes, and the fork server where there is one (shared pages split between
    them, so the sum is what they add to the machine)."""
    from asyncrl.utils.affinity import process_tree

    total_kb = 0
    for pid in process_tree(os.getpid())[1:]:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kb += next(int(x.split()[1]) for x in f if x.startswith("Pss:"))
        except (OSError, StopIteration):  # ended meanwhile
            continue
    return total_kb / 1024


def main() -> None:
    p = parser("engine_start", __doc__)
    p.add_argument("--rounds", type=int, default=3, help="pairs of starts (default 3)")
    p.add_argument("--batches", type=int, default=5, help="timed batches per start")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # one measurement
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batches)), flush=True)
        return
    rounds = 2 if a.quick else a.rounds
    batches = 3 if a.quick else a.batches
    rows = []
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = [sys.executable, "-m", "benchmarks.engine_start", "--child", side,
                   "--batches", str(batches)]  # fmt: skip
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"engine_start --child {side}: {out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1]) | {"round": r}
            rows.append(row)
            print(f"round {r} {side}: start {row['start_seconds']:.1f} s, "
                  f"{row['tokens_per_s']:.0f} tokens/s", flush=True)  # fmt: skip
    med = {
        s: {k: statistics.median(x[k] for x in rows if x["side"] == s)
            for k in ("start_seconds", "tokens_per_s", "engine_pss_mb")}
        for s in SIDES
    }  # fmt: skip
    print_table(
        "engine start and generation (medians)",
        ["side", "start_seconds", "tokens_per_s", "engine_pss_mb"],
        [
            [s, med[s]["start_seconds"], med[s]["tokens_per_s"], med[s]["engine_pss_mb"]]
            for s in SIDES
        ],  # fmt: skip
    )
    write_csv(a.out / "engine_start.csv", rows, run_fingerprint())
    plot(a.out / "engine_start.png", rows)
    emit_json({
        "start_seconds_in_core": med["in_core"]["start_seconds"],
        "start_seconds_separate": med["separate"]["start_seconds"],
        "start_ratio": ratio(med["separate"]["start_seconds"], med["in_core"]["start_seconds"]),
        "tokens_per_s_in_core": med["in_core"]["tokens_per_s"],
        "tokens_per_s_separate": med["separate"]["tokens_per_s"],
        "generation_ratio": ratio(med["in_core"]["tokens_per_s"], med["separate"]["tokens_per_s"]),
        "start_seconds_forked": med["forked"]["start_seconds"],
        "tokens_per_s_forked": med["forked"]["tokens_per_s"],
        "fork_start_ratio": ratio(med["in_core"]["start_seconds"], med["forked"]["start_seconds"]),
        "fork_generation_ratio": ratio(
            med["forked"]["tokens_per_s"], med["in_core"]["tokens_per_s"]
        ),
        **{f"engine_pss_mb_{s}": med[s]["engine_pss_mb"] for s in SIDES},
        "rounds": rounds,
    })  # fmt: skip


def plot(path: Path, rows: list[dict]) -> None:
    """Each start's seconds and tokens/s, per side and round."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key in zip(axes, ("start_seconds", "tokens_per_s")):
        for side in SIDES:
            mine = [r for r in rows if r["side"] == side]
            ax.plot([r["round"] for r in mine], [r[key] for r in mine], "o-", label=side)
        ax.set_xlabel("round")
        ax.set_title(key)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
