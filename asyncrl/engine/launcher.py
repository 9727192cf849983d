"""Engine-core processes forked from a warm server instead of spawned fresh.

vLLM's CPU platform starts the engine-core process with ``spawn``: a new interpreter
that imports torch and vLLM again (~10 s of one core here) after the front end has
already imported them. ``fork`` from the front end would skip that, but a process that
has run an OpenMP region cannot fork safely (GNU OpenMP's threads are not in the
child: the child's first parallel region hangs, as vLLM's worker does when it binds
its threads). Python's ``forkserver`` is the safe middle: a server process, started
once and early, imports what the engine core needs and never computes; each engine
core is forked from it, already imported, in well under a second.

:func:`warm` starts that server in the background (the actor calls it first thing,
so the server's imports overlap the front end's own); within :func:`engine_core_start`
vLLM starts its engine-core process through it. A forked child gets what a spawned
one would inherit from the process that starts it, not the server's: the starter's
environment (vLLM and asyncrl set variables just before the start), working
directory and CPU affinity (the actor's placement narrows it), carried by
:class:`CarriedProcess`.

Used where the engine's one worker runs in the engine-core process
(asyncrl/engine/in_core.py; ``actor.engine.forkserver``, chosen in
:func:`asyncrl.engine.vllm_engine.forks_engine_core`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import os
import threading
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext, ForkServerProcess

# what an engine core imports before it runs: vLLM's engine core and executors, and
# the asyncrl parts vLLM resolves by name there
PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "asyncrl.engine.in_core",
    "asyncrl.engine.worker_ext",
)
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # read by vLLM when it is imported
LOG_LEVEL = "WARNING"

_LOCK = threading.Lock()
_WARM = threading.Event()  # set once the server's start is under way


class CarriedProcess(ForkServerProcess):
    """A forkserver child that runs with its starter's environment, working directory
    and CPU affinity (read at :meth:`start`), as a spawned child would."""

    def start(self) -> None:
        self.carried = (dict(os.environ), os.getcwd(), sorted(os.sched_getaffinity(0)))
        super().start()

    def run(self) -> None:
        env, cwd, cpus = self.carried
        # by difference: clearing the whole environment moves it away from where
        # setproctitle finds it, and vLLM's title (VLLM::EngineCore) would not show
        for k in [k for k in os.environ if k not in env]:
            del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        os.chdir(cwd)
        os.sched_setaffinity(0, cpus)
        super().run()


class CarriedContext(ForkServerContext):
    Process = CarriedProcess


CONTEXT = CarriedContext()


def warm() -> None:
    """Start the fork server in the background (no wait); a later start waits for it.
    Idempotent."""
    with _LOCK:
        if _WARM.is_set():
            return
        _WARM.set()
        os.environ.setdefault(LOG_LEVEL_ENV, LOG_LEVEL)
        multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
        threading.Thread(
            target=multiprocessing.forkserver.ensure_running, name="engine-forkserver",
            daemon=True,
        ).start()  # fmt: skip


@contextlib.contextmanager
def engine_core_start(forked: bool) -> Iterator[None]:
    """Within: vLLM starts its engine-core process from the fork server (``forked``;
    the server is started here if :func:`warm` was not called), else as vLLM does."""
    if not forked:
        yield
        return
    warm()
    import vllm.v1.engine.utils as engine_utils

    own = engine_utils.get_mp_context
    engine_utils.get_mp_context = mp_context
    try:
        yield
    finally:
        engine_utils.get_mp_context = own


def mp_context() -> CarriedContext:
    """What vLLM's ``get_mp_context`` returns where it starts the engine core."""
    return CONTEXT
