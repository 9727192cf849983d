"""Engine-core processes forked from a warm server instead of spawned fresh.

vLLM's CPU platform starts the engine-core process with ``spawn``: a new interpreter
that imports torch and vLLM again (~10 s of one core here) after the front end has
already imported them. Forking the front end itself when the engine starts is not
safe: a process that has run an OpenMP region cannot fork (GNU OpenMP's threads are not
in the child: the child's first parallel region hangs, as vLLM's worker does when it
binds its threads). What is safe is to fork once early, before any OpenMP region: a
fork server that never computes, from which each engine core is forked in well under
a second, already imported.

:func:`warm`, called first thing in a fresh process (the actor's ``__init__``), imports
what an engine core needs (:data:`PRELOAD`) and forks multiprocessing's fork server
from this process (:class:`ForkedServer`), so that these imports are paid once, not
again in a server of its own. The server keeps only its listening socket and its
"alive" pipe of the parent's file descriptors (a Ray worker's sockets are not held
open by it), and exits without running the parent's exit handlers. Where no
:func:`warm` came first (an engine started in a process that may have computed),
multiprocessing's own fork server is spawned as a fresh interpreter that imports
:data:`PRELOAD` itself. Within :func:`engine_core_start` vLLM starts its engine-core
process through the server. A forked child gets what a spawned one would inherit from
the process that starts it, not the server's: the starter's environment (vLLM and
asyncrl set variables just before the start), working directory and CPU affinity (the
actor's placement narrows it), carried by :class:`CarriedProcess`.

Used where the engine's one worker runs in the engine-core process
(asyncrl/engine/in_core.py; ``actor.engine.forkserver``, chosen in
:func:`asyncrl.engine.vllm_engine.forks_engine_core`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing import connection, resource_tracker, util
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import NoReturn

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
SERVER_TITLE = "asyncrl::engine-forkserver"

_LOCK = threading.Lock()
_WARMING = threading.Event()  # warm() was called
_WARMED = threading.Event()  # and its thread is done (forked, or failed)
log = logging.getLogger(__name__)


class ForkedServer(multiprocessing.forkserver.ForkServer):
    """multiprocessing's fork server, started by forking this process once it has
    imported :data:`PRELOAD` (``fork_here``, set by :func:`warm`) instead of spawning
    an interpreter that imports them again. A server that has died is replaced by a
    spawned one: by then this process may have run OpenMP regions."""

    fork_here = False

    def ensure_running(self) -> None:
        with self._lock:
            if self.fork_here:
                if self._forkserver_pid is None:
                    self.fork()
                    return
                if self.forked_alive():
                    return
                self.fork_here = False  # died: this process may have computed since
        super().ensure_running()

    def forked_alive(self) -> bool:
        """Whether the server forked from here runs; a dead one is forgotten."""
        if self._forkserver_pid is None:
            return False
        try:
            if not os.waitpid(self._forkserver_pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:  # dead, and already reaped by someone else
            pass
        os.close(self._forkserver_alive_fd)
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None
        return False

    def fork(self) -> None:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # every client owns the write end of "alive"; all gone, the server ends
            alive_r, alive_w = os.pipe()
            gc.collect()  # no garbage of this process left to be finalised there
            pid = os.fork()
            if pid == 0:
                serve(listener.fileno(), alive_r)
            os.close(alive_r)
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._forkserver_pid = pid


def serve(listener_fd: int, alive_r: int) -> NoReturn:
    """The forked server's life: only its two descriptors and stdio kept, SIGTERM's
    default action back (a Ray worker's handler would act on Ray's state), its heap
    frozen for the collector, then multiprocessing's server loop; it leaves by ``os._exit``, running none of the
    parent's exit handlers."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        title_here(SERVER_TITLE)
        # what is here now stays: the engine cores' full collections (vLLM's loader
        # runs them) skip these objects instead of walking the parent's whole heap
        gc.freeze()
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit:  # the last client is gone
        code = 0
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


def title_here(title: str) -> None:
    """Title this process (``ps`` shows it; the tests find engine cores by
    ``VLLM::EngineCore``). In a Ray worker's fork the setproctitle package cannot find
    the command line's memory (Ray's own setter took it over), so its ``setproctitle``,
    which vLLM's engine core calls in the children, is pointed at Ray's setter here."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
    raylet = sys.modules.get("ray._raylet")
    if setproctitle.getproctitle() != title and raylet is not None:
        setproctitle.setproctitle = raylet.setproctitle
        raylet.setproctitle(title)


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
# the fork server every forkserver start of this process goes through (multiprocessing
# keeps one per process: its module functions are bound to it), made a ForkedServer
SERVER = multiprocessing.forkserver.connect_to_new_process.__self__
SERVER.__class__ = ForkedServer  # its state unchanged; only ensure_running differs
SERVER.set_forkserver_preload(list(PRELOAD))  # what a spawned one imports


def own_actor_process() -> bool:
    """Whether this process is a Ray actor's own: its constructor is the first code of
    ours that runs there (an in-process use, e.g. a test's, may have computed)."""
    ray = sys.modules.get("ray")
    return bool(
        ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id()
    )


def warm() -> None:
    """First thing in a fresh process that will start engines (before any OpenMP region
    runs in it): in a thread of its own, import :data:`PRELOAD` and fork the fork
    server from this process; :func:`settle` waits for it. Idempotent."""
    with _LOCK:
        if _WARMING.is_set():
            return
        _WARMING.set()
    threading.Thread(target=warm_now, name="engine-forkserver", daemon=True).start()


def warm_now() -> None:
    try:
        os.environ.setdefault(LOG_LEVEL_ENV, LOG_LEVEL)
        for name in PRELOAD:
            importlib.import_module(name)
        SERVER.fork_here = True
        SERVER.ensure_running()
    except Exception:  # noqa: BLE001 - the engine start then spawns a server
        log.warning("the engine fork server could not be forked here", exc_info=True)
        SERVER.fork_here = False
    finally:
        _WARMED.set()


def settle() -> None:
    """Before this process imports vLLM or starts an engine: wait for a :func:`warm`
    under way (the fork must not meet an import half done in another thread)."""
    if _WARMING.is_set():
        _WARMED.wait()


@contextlib.contextmanager
def engine_core_start(forked: bool) -> Iterator[None]:
    """Within: vLLM starts its engine-core process from the fork server (``forked``;
    the server is started here if :func:`warm` was not called), else as vLLM does."""
    if not forked:
        yield
        return
    settle()
    os.environ.setdefault(LOG_LEVEL_ENV, LOG_LEVEL)  # for a server spawned now
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
