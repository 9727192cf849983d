"""The engine's one worker inside the engine-core process (asyncrl/engine/in_core.py):
when it is chosen, and how the actor's placement moves that process's I/O threads by
id while its main thread (the scheduler and the model) stays on the engine's cores.
The whole engine in this layout runs in every vLLM test (it is the CPU default);
benchmarks/engine_start.py runs both layouts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncrl.engine.settings import EngineSettings
from asyncrl.engine.vllm_engine import IN_CORE_EXECUTOR, on_cpu, worker_in_core


@pytest.mark.skipif(not on_cpu(), reason="the in-core worker is the CPU's layout")
def test_chosen_on_a_cpu_for_one_worker_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    on = EngineSettings.defaults()
    assert on.in_core_worker is True  # conf/actor/default.yaml
    assert worker_in_core(on, {})
    assert not worker_in_core(EngineSettings.defaults(in_core_worker=False), {})
    assert not worker_in_core(on, {"tensor_parallel_size": 2})  # two workers: vLLM's own
    assert not worker_in_core(on, {"distributed_executor_backend": "mp"})  # the user's
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no engine-core process
    assert not worker_in_core(on, {})
    module, name = IN_CORE_EXECUTOR.rsplit(".", 1)
    import importlib

    executor = getattr(importlib.import_module(module), name)
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert issubclass(executor, UniProcExecutor) and executor is not UniProcExecutor


def test_io_threads_are_listed_only_where_the_worker_runs_in_the_engine_core():
    from asyncrl.engine import in_core

    assert in_core.io_threads() == []  # this process holds no engine core


def test_placement_moves_the_listed_io_threads_and_leaves_the_main_thread(monkeypatch):
    from asyncrl.actor.placement import place_engine, place_frontend
    from asyncrl.utils.affinity import pin_tree, process_tree

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # restored afterwards
    allowed = os.sched_getaffinity(0)
    engine_core = max(allowed)
    # the engine-core process with its worker inside: no children; its main thread
    # runs the scheduler and the model, a side thread stands for its sockets
    stand_in = (
        "import threading, time\n"
        "t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start()\n"
        "print(t.native_id, flush=True)\n"
        "time.sleep(30)\n"
    )
    child = None
    try:
        cores = place_engine({engine_core})
        child = subprocess.Popen(
            [sys.executable, "-c", stand_in], stdout=subprocess.PIPE, text=True
        )
        side = int(child.stdout.readline())
        placement = place_frontend(*cores, core_io=[side])
        frontend = allowed - {engine_core} or allowed
        assert os.sched_getaffinity(child.pid) == {engine_core}
        assert os.sched_getaffinity(side) == frontend
        assert placement["engine_io_threads"] == (1 if frontend != {engine_core} else 0)
    finally:
        if child is not None:
            for p in reversed(process_tree(child.pid)):
                os.kill(p, 9)
            child.wait()
        pin_tree(os.getpid(), allowed)
