"""vLLM's single-process executor, named by class so that vLLM's CPU platform keeps it.

A vLLM-CPU engine is by default three processes, each importing torch and vLLM: the
front end (the actor's), the engine core, and one worker. With one worker, this
executor runs it inside the engine-core process instead, as vLLM does on a GPU, so the
engine is up one process start sooner (``actor.engine.in_core_worker``, chosen in
:func:`asyncrl.engine.vllm_engine.worker_in_core`). vLLM's CPU platform swaps the
executor named ``"uni"`` for its multiprocess one; a subclass, named by its class,
is kept. The worker binds its OpenMP threads as it does in a process of its own
(``VLLM_CPU_OMP_THREADS_BIND``); the engine core's main thread is OpenMP's first.

Importing this module imports vLLM: only the engine-core process does (vLLM resolves
the class by name there)."""

from __future__ import annotations

import os
import threading

from vllm.v1.executor.uniproc_executor import UniProcExecutor

_ACTIVE = threading.Event()  # set in the process whose engine core holds the worker


class InCoreExecutor(UniProcExecutor):
    """The engine's one worker, in the engine-core process."""

    def _init_executor(self) -> None:
        _ACTIVE.set()
        super()._init_executor()


def io_threads() -> list[int]:
    """Thread ids of the engine-core process's I/O, where the worker runs in it: its
    Python threads other than the caller's (the engine core's main thread, which also
    runs the model: OpenMP's first thread) and ZeroMQ's. OpenMP's other threads are
    not Python threads and keep their binding. Elsewhere: none."""
    if not _ACTIVE.is_set():
        return []
    me = threading.get_native_id()
    tids = {t.native_id for t in threading.enumerate() if t.native_id not in (None, me)}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg"):
                    tids.add(int(tid))
        except OSError:  # the thread ended
            continue
    return sorted(tids)
