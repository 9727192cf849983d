"""CPU placement of one rollout actor (``actor.engine_cores``): the vLLM engine's
processes on the engine's cores, the actor's own process (its event loop: vLLM's
frontend, the episodes, the hand-offs) and the engine-core process's I/O threads on
the others.

    place_engine(engine)            before the engine starts: this process moves to
                                    the engine's cores, so what vLLM spawns starts there
    ── make_engine ──
    place_frontend(engine, front,   after: the engine's processes stay, this process
                   core_io)         and the engine-core I/O threads move to ``front``

Affinity is per thread; a process or thread started later inherits it from the
thread that starts it (asyncrl/utils/affinity.py).
"""

from __future__ import annotations

import os
from typing import Any

from asyncrl.engine.vllm_engine import on_cpu
from asyncrl.utils.affinity import children, pin_threads, pin_tids, process_tree


def place_engine(engine: set[int]) -> tuple[set[int], set[int]]:
    """Before the engine starts: this process's threads go to the engine's cores, so
    the processes vLLM spawns start there (they inherit it), and vLLM binds its CPU
    worker's OpenMP threads to them. Returns (engine cores, frontend cores)."""
    allowed = os.sched_getaffinity(0)
    if not engine <= allowed:
        raise ValueError(
            f"actor.engine_cores {sorted(engine)}: this actor may only use cores {sorted(allowed)}"
        )
    frontend = allowed - engine or allowed  # one core: both share it
    if on_cpu():
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(engine)))
    pin_threads(os.getpid(), engine)
    return engine, frontend


def place_frontend(
    engine: set[int], frontend: set[int], core_io: list[int] | None = None
) -> dict[str, Any]:
    """After the engine started: its processes stay on ``engine``; this process moves
    to ``frontend``, where its work no longer delays the engine's steps. Returns the
    placement (the actor reports it in its stats).

    So do the engine-core process's threads other than its main one (the scheduler's
    loop): the sockets that take requests in and send outputs out, and ZeroMQ's I/O.
    They are about an eighth of the engine's CPU, and where a new request arrives
    every millisecond or two they would keep interrupting the forward passes on the
    engine's cores. With its own worker processes, the engine-core process is the one
    whose children are the workers; a worker keeps all its threads (OpenMP's) on
    ``engine``. With the worker inside it (asyncrl/engine/in_core.py), ``core_io``
    names its I/O threads (the worker's ``asyncrl_io_threads``): its main thread and
    OpenMP's stay."""
    me = os.getpid()
    for pid in process_tree(me):
        if pid != me:
            pin_threads(pid, engine)
    io_threads = 0
    if frontend != engine:
        io_threads = move_engine_io(frontend, core_io)
    pin_threads(me, frontend)
    return {
        "engine_cores": sorted(engine),
        "frontend_cores": sorted(frontend),
        "engine_io_threads": io_threads,  # engine-core threads moved to frontend_cores
    }


def move_engine_io(cores: set[int], core_io: list[int] | None = None) -> int:
    """The engine-core process's I/O threads onto ``cores``: ``core_io`` by thread id
    where the worker runs inside that process, else :func:`pin_engine_io`. Returns
    how many threads moved."""
    return pin_tids(core_io, cores) if core_io else pin_engine_io(cores)


def pin_engine_io(cores: set[int]) -> int:
    """Pin the engine-core process's threads other than its main one (the scheduler's
    loop) to ``cores``; returns how many. The engine-core process is the child of
    this one whose own children are the workers."""
    return sum(
        pin_threads(pid, cores, skip_main=True) for pid in children(os.getpid()) if children(pid)
    )
