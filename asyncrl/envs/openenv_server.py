"""Local OpenEnv servers for ``env=openenv``: processes on loopback that live and die with
the process that started them (a rollout actor).

    episode ──await pool.lease()──▶ ServerPool (one per actor process and settings)
       │                              ├─ ServerProcess 0: python -c LAUNCHER module:app fd
       │ ws://127.0.0.1:<port>/ws     │    uvicorn serving the app on a socket this
       └── reset / step (openenv's    │    process bound to 127.0.0.1:0 and handed over
           EnvClient) ─────────────▶  └─ ServerProcess 1 ...

* Loopback only: the pool binds the listening socket itself (127.0.0.1, a free port) and
  passes it to uvicorn (``--fd``), so the server can listen nowhere else and no port is
  raced for.
* A lease waits while every server holds ``sessions_per_server`` episodes; it starts (or
  restarts) its server when that server is not running, and waits for ``/health``.
* A dead server (crashed) is restarted by the next lease; a server that stops answering
  (:meth:`ServerPool.check`: no ``/health`` within ``HEALTH_TIMEOUT_S``) is killed first.
  The episodes it held raise, and the runner scores them ``finish_reason="env_error"``.
* Lifetime: the server runs in its own process group with ``PR_SET_PDEATHSIG`` (SIGKILL
  when the thread that started it dies: start servers from a thread that lives as long
  as the pool, here the actor's event loop); it inherits the run's ``ASYNCRL_RUN`` mark,
  so the run's watchdog (asyncrl/utils/watchdog.py) sweeps it if the driver dies;
  :meth:`ServerPool.close` and an ``atexit`` hook kill every group this process started.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.envs.settings import OpenEnvSettings

HEALTH_TIMEOUT_S = 5.0  # a server that cannot answer /health this fast is hung
POLL_S = 0.05  # how often a waiting lease or a starting server is looked at again
EXIT_WAIT_S = 1.0  # a server whose socket closed may take this long to exit (crashed)
TERM_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this long
LOG_TAIL_CHARS = 600  # of the server's output, quoted when it fails to start

LAUNCHER = """
import ctypes, os, signal, sys
ppid = int(sys.argv[3])
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != ppid:
    sys.exit(1)  # the parent died before the prctl
import importlib, uvicorn
module, _, attr = sys.argv[1].partition(":")
app = getattr(importlib.import_module(module), attr or "app")
uvicorn.run(app, fd=int(sys.argv[2]), log_level="warning", access_log=False)
"""


class OpenEnvServerError(RuntimeError):
    """A server failed an episode (would not start, crashed, hung, answered garbage):
    the env raises it and the runner records ``finish_reason="env_error"``."""


@dataclass(eq=False)
class ServerProcess:
    """One uvicorn process serving ``target`` on 127.0.0.1 (a new port each start)."""

    target: str
    index: int = 0
    proc: subprocess.Popen | None = None
    port: int = 0
    starts: int = 0  # 1 + restarts
    sessions: int = 0  # episodes leased now
    starting: bool = False
    ready: bool = False  # answered /health since its last start
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, logdir: Path) -> None:
        """Start the process on a fresh loopback socket (quick: no waiting for it)."""
        self.kill()
        self.ready = False
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            self.starts += 1
            self.log = logdir / f"server{self.index}-{self.starts}.log"
            paths = [p for p in sys.path if p] + [os.getcwd()]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", LAUNCHER, self.target, str(sock.fileno()),
                     str(os.getpid())],
                    pass_fds=(sock.fileno(),), env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
        finally:
            sock.close()  # the child holds its own copy

    def kill(self) -> None:
        """SIGKILL the server's process group and reap it (a no-op when none runs)."""
        if self.proc is None:
            return
        for kill in (os.killpg, os.kill):
            try:
                kill(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL what is left after ``TERM_GRACE_S``."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(TERM_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def log_tail(self) -> str:
        try:
            text = self.log.read_text(errors="replace") if self.log else ""
        except OSError:
            return ""
        return " ".join(text[-LOG_TAIL_CHARS:].split())


async def healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether ``GET url/health`` answers 200 within ``timeout_s`` (raw HTTP/1.0)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
                await writer.drain()
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status.split(b" ")[1:2] == [b"200"]


@dataclass(eq=False)
class Lease:
    """One episode's server: its URL and the start it belongs to (a restart since makes
    the lease stale)."""

    server: ServerProcess
    start: int
    url: str
    released: bool = False


@dataclass(eq=False)
class ServerPool:
    """``settings.servers`` server processes for ``settings.server``; see the module doc."""

    settings: OpenEnvSettings
    servers: list[ServerProcess] = field(default_factory=list)
    restarts: int = 0  # servers started again after a crash or a hang
    closed: bool = False

    def __post_init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-openenv-"))
        self.servers = [
            ServerProcess(self.settings.server, i) for i in range(self.settings.servers)
        ]
        _POOLS.append(self)

    async def lease(self) -> Lease:
        """A server with room for one more episode, running and healthy."""
        cap = self.settings.sessions_per_server
        while True:
            if self.closed:
                raise OpenEnvServerError("the OpenEnv server pool is closed")
            free = [s for s in self.servers if s.sessions < cap]
            if free:
                server = min(free, key=lambda s: s.sessions)
                break
            await asyncio.sleep(POLL_S)
        server.sessions += 1
        try:
            await self._ensure(server)
        except BaseException:
            server.sessions -= 1
            raise
        return Lease(server, server.starts, server.url)

    def release(self, lease: Lease) -> None:
        if not lease.released:
            lease.released = True
            lease.server.sessions -= 1

    async def _ensure(self, server: ServerProcess) -> None:
        """Start ``server`` if it is not running (one starter; other leases wait)."""
        while server.starting:
            await asyncio.sleep(POLL_S)
        if server.alive() and server.ready:
            return
        server.starting = True
        try:
            if not server.alive():  # else: a start whose wait was cancelled, waited for again
                if server.starts:
                    self.restarts += 1
                server.spawn(self._dir)
            await self._ready(server)
        finally:
            server.starting = False

    async def _ready(self, server: ServerProcess) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if not server.alive():
                tail = server.log_tail()
                server.kill()
                raise OpenEnvServerError(
                    f"env.server={self.settings.server}: the server exited at start-up: {tail}"
                )
            if await healthy(server.url, POLL_S * 20):
                server.ready = True
                return
            await asyncio.sleep(POLL_S)
        server.kill()
        raise OpenEnvServerError(
            f"env.server={self.settings.server}: not healthy within "
            f"env.start_timeout_s={self.settings.start_timeout_s}"
        )

    async def check(self, lease: Lease) -> str:
        """After a failed call: kill the lease's server if it is dead or hung (the next
        lease starts it again); returns what was found ("crashed", "hung" or "")."""
        server = lease.server
        if server.starts != lease.start or server.starting:
            return "restarted"  # another episode saw it first
        if not server.alive():
            server.kill()
            return "crashed"
        if await healthy(server.url):
            return ""
        deadline = time.monotonic() + EXIT_WAIT_S
        while server.alive() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        found = "hung" if server.alive() else "crashed"
        server.kill()
        return found

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers if s.alive()]

    def close(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL) and remove the logs."""
        if self.closed:
            return
        self.closed = True
        for s in self.servers:
            s.stop()
        for p in self._dir.glob("*"):
            p.unlink(missing_ok=True)
        try:
            self._dir.rmdir()
        except OSError:
            pass


_POOLS: list[ServerPool] = []
_SHARED: dict[OpenEnvSettings, ServerPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(settings: OpenEnvSettings) -> ServerPool:
    """This process's pool for ``settings`` (built on first use, shared by its episodes)."""
    with _SHARED_LOCK:
        pool = _SHARED.get(settings)
        if pool is None or pool.closed:
            pool = _SHARED[settings] = ServerPool(settings)
        return pool


@atexit.register
def close_all() -> None:
    """Stop every server this process started (at exit, and after SIGINT's
    KeyboardInterrupt)."""
    for pool in list(_POOLS):
        pool.close()
    _POOLS.clear()
    _SHARED.clear()
