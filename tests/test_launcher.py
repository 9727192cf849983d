"""Engine-core processes forked from the fork server (asyncrl/engine/launcher.py): a
forked child runs with what its starter had at start() (environment, working directory,
CPU affinity), not what the server had when it started; vLLM's start is redirected only
within ``engine_core_start``; the processes that only hold an actor's handle (the queue,
the broker) do not import torch. Every vLLM engine of the suite is started this way
(the CPU default); benchmarks/engine_start.py measures it against a fresh spawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from asyncrl.engine import launcher
from asyncrl.engine.settings import EngineSettings
from asyncrl.engine.vllm_engine import engine_kwargs, forks_engine_core, on_cpu

LIGHT = "wave"  # what the test's fork server imports first (nothing else here does)


def report(queue) -> None:
    """A forked child's view of its start, put on ``queue``; it titles itself as vLLM's
    engine core does (tests and the supervisor find engine cores by that title)."""
    import setproctitle

    server = os.getppid()  # the fork server
    imported = LIGHT in sys.modules  # before this child imports anything
    setproctitle.setproctitle("VLLM::LauncherTest")
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().split(b"\0")[0].decode()
    with open(f"/proc/{server}/cmdline", "rb") as f:
        server_title = f.read().replace(b"\0", b" ").decode()
    with open(f"/proc/{server}/stat") as f:
        server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    held = sorted(os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd"))
    queue.put(
        dict(carried=os.environ.get("ASYNCRL_TEST_CARRIED"), cwd=os.getcwd(),
             cpus=sorted(os.sched_getaffinity(0)), gone=os.environ.get("ASYNCRL_TEST_GONE"),
             title=title, imported=imported, server=server, server_title=server_title,
             server_parent=server_parent, held=held)
    )  # fmt: skip


def starts(tmp_path) -> list[dict]:
    """In a fresh process (as the actor's): :func:`launcher.warm` first, then a child
    started through the server with an environment, directory and affinity changed
    since; then the server killed and another child started. Each child's view."""
    import json
    import signal
    import socket

    from asyncrl.engine import launcher

    # a light module in place of vLLM's (the suite's engines start the real way)
    launcher.PRELOAD = (LIGHT,)
    launcher.SERVER.set_forkserver_preload([LIGHT])
    assert LIGHT not in sys.modules
    os.environ["ASYNCRL_TEST_GONE"] = "unset before the start"
    marker = socket.socket()  # one of this process's sockets (a Ray worker holds many)
    launcher.warm()  # the server is forked now, with this environment
    launcher.settle()
    os.environ["ASYNCRL_TEST_CARRIED"] = "set after the server started"
    del os.environ["ASYNCRL_TEST_GONE"]
    os.chdir(tmp_path)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-1:])  # as placement narrows it
    views = []
    for _ in range(2):
        q = launcher.CONTEXT.Queue()
        p = launcher.CONTEXT.Process(target=report, args=(q,))
        p.start()
        views.append({**q.get(timeout=120), "exitcode": p.join(timeout=60) or p.exitcode})
        if len(views) == 1:
            os.kill(views[0]["server"], signal.SIGKILL)  # the next start spawns one
            while os.waitpid(views[0]["server"], os.WNOHANG)[0] == 0:
                pass
    views.append({"me": os.getpid(), "marker": f"socket:[{os.fstat(marker.fileno()).st_ino}]"})
    print(json.dumps(views))


def test_a_forked_child_runs_with_what_its_starter_had_at_start(tmp_path):
    """The server is forked from the process that warms (what it imports first already
    imported in every child, none of the process's sockets held open by the server);
    a child runs with its starter's environment, directory and affinity at start();
    a dead forked server is replaced by a spawned one, which carries the same."""
    program = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_launcher; test_launcher.starts(__import__('pathlib').Path({str(tmp_path)!r}))"
    r = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    forked, spawned, me = json.loads(r.stdout.strip().splitlines()[-1])
    narrowed = sorted(os.sched_getaffinity(0))[-1:]
    for view in (forked, spawned):
        assert (view["carried"], view["cwd"], view["cpus"], view["gone"], view["title"]) == (
            "set after the server started",
            str(tmp_path),
            narrowed,
            None,
            "VLLM::LauncherTest",
        ), view
        assert view["imported"] and view["server_parent"] == me["me"] and view["exitcode"] == 0
    assert forked["server_title"].startswith(launcher.SERVER_TITLE), forked["server_title"]
    assert me["marker"] not in forked["held"], forked["held"]
    assert "multiprocessing.forkserver" in spawned["server_title"], spawned["server_title"]


def test_vllm_starts_through_the_server_only_within_engine_core_start():
    import vllm.v1.engine.utils as engine_utils

    own = engine_utils.get_mp_context
    with launcher.engine_core_start(False):
        assert engine_utils.get_mp_context is own
    with launcher.engine_core_start(True):
        assert engine_utils.get_mp_context() is launcher.CONTEXT
    assert engine_utils.get_mp_context is own
    with pytest.raises(RuntimeError), launcher.engine_core_start(True):
        raise RuntimeError("a failed start")
    assert engine_utils.get_mp_context is own  # restored on failure too


@pytest.mark.skipif(not on_cpu(), reason="the in-core worker is the CPU's layout")
def test_forked_with_the_worker_in_the_engine_core_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)

    def forked(**kw) -> bool:
        s = EngineSettings.defaults(**kw)
        return forks_engine_core(s, engine_kwargs("m", s))

    assert EngineSettings.defaults().forkserver is True  # conf/actor/default.yaml
    assert forked()
    assert not forked(forkserver=False)
    assert not forked(in_core_worker=False)  # vLLM's executor starts its own workers
    assert not forked(tensor_parallel_size=2)


def test_the_processes_that_only_hold_an_actor_handle_do_not_import_torch():
    """Ray imports an actor's class module wherever its handle is deserialised (the
    queue and the broker get the actors' handles; the broker, the evaluator and the
    supervisor the learner ranks'): none of these import torch."""
    program = (
        "import sys\n"
        "import asyncrl.actor.rollout, asyncrl.replay.queue, asyncrl.broker.weight_broker\n"
        "import asyncrl.learner.rank\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_drivers_checks_before_ray_do_not_import_transformers(tiny_model):
    """The driver up to Ray (``asyncrl.train``'s imports and ``prepare`` of the default
    run, the tiny model's architecture stamped by an earlier start): no transformers,
    no vLLM; torch only for the loss object it builds."""
    program = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "import asyncrl.train\n"
        "assert 'torch' not in sys.modules, 'asyncrl.train imports torch'\n"
        "from asyncrl.wiring import prepare\n"
        "with initialize_config_dir(str(asyncrl.train.CONF_DIR), version_base=None):\n"
        "    cfg = compose('config', overrides=[f'model.path={sys.argv[1]}'])\n"
        "prepare(cfg)\n"
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", program, str(tiny_model)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.strip() == "[]", runs[1].stdout  # the first may have stamped
