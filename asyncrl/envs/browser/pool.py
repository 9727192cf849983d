"""A pool of headless Chromium browsers for ``env=browser``, driven by Playwright's async
API on the pool's own thread and event loop (any caller's loop only awaits).

    caller loop ──await pool.open(site) / act / observe──▶ pool thread: Playwright
                                                             ├─ Chromium 1 ─ contexts
                                                             ├─ Chromium 2 ─ contexts
                                                             └─ TaskServer (127.0.0.1)

* ``browsers`` Chromium processes (the system's ``chromium``: no browser download), at
  most ``contexts_per_browser`` episodes on each; one fresh browser context per episode.
* Network: every request of a context is routed, and only ``http://127.0.0.1:<task
  server's port>`` goes through; any other host or port is aborted before a connection
  is made and recorded in :attr:`Session.refused`. Chromium itself is launched with a
  proxy on a dead loopback port (bypassed only for the task server) and a resolver that
  resolves no name, so nothing else is reachable even past the routing.
* Limits: an action (or reading the page) that outlives ``action_timeout_s`` is a hung
  page: its context is closed (its browser killed and relaunched if that fails too) and
  :class:`BrowserError` is raised; a session older than ``episode_timeout_s`` is closed
  by the pool and its next call raises. A browser that crashed is relaunched on the
  next episode; its episodes in flight raise :class:`BrowserError`.
* Lifetime: Chromium runs under a wrapper that sets ``PR_SET_PDEATHSIG`` (SIGKILL when
  Playwright's driver, its parent, dies; the driver exits when this process does) in its
  own process group, which :meth:`BrowserPool.close` kills whole; an ``atexit`` hook
  closes every pool this process made.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from asyncrl.envs.browser.server import TaskServer
from asyncrl.envs.browser.sites import Site
from asyncrl.envs.browser.tree import WALK_JS

T = TypeVar("T")
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser")
CLOSE_TIMEOUT_S = 5.0  # closing a context or a browser that takes longer: killed
REAP_EVERY_S = 1.0

WRAPPER = """#!{python} -IS
import ctypes, os, signal, sys
ppid = os.getppid()
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != ppid:
    sys.exit(1)  # the parent died before the prctl
pidfile = os.environ.get("ASYNCRL_BROWSER_PIDFILE")
if pidfile:
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
os.execv({chromium!r}, [{chromium!r}] + sys.argv[1:])
"""


class BrowserError(RuntimeError):
    """The browser failed the episode (hung page, crashed browser, episode over time):
    the env raises it, and the runner records ``finish_reason="env_error"``."""


@dataclass(frozen=True)
class PoolSettings:
    browsers: int = 1
    contexts_per_browser: int = 4
    action_timeout_s: float = 10.0
    episode_timeout_s: float = 120.0
    executable: str = ""  # "" : the first of CHROMIUM_PATHS that exists

    def __post_init__(self) -> None:
        for key in ("browsers", "contexts_per_browser"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"env.{key}={v!r}: expected an integer >= 1")
        for key in ("action_timeout_s", "episode_timeout_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"env.{key}={v!r}: expected a number > 0")


def find_chromium(executable: str = "") -> str:
    """The Chromium binary: ``executable``, or the system's (Debian's ``chromium``)."""
    for p in (executable,) if executable else CHROMIUM_PATHS:
        if p and os.access(p, os.X_OK):
            return p
    raise ValueError(
        f"env.executable={executable!r}: no Chromium found (tried {executable or CHROMIUM_PATHS}); "
        "install Debian's `chromium` (scripts/setup.sh does, as root)"
    )


@dataclass(eq=False)
class Session:
    """One episode's browser context and page (lives on the pool's loop)."""

    token: str
    site: Site
    slot: _Slot
    browser: Any = None  # the Chromium it runs in (its slot may have relaunched since)
    context: Any = None
    page: Any = None
    deadline: float = 0.0
    refused: list[str] = field(default_factory=list)  # URLs the routing aborted
    closed: bool = False
    expired: bool = False


@dataclass
class _Slot:
    index: int
    browser: Any = None
    pid: int = 0
    sessions: int = 0
    launches: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class BrowserPool:
    """``settings.browsers`` Chromium processes and a task server; see the module doc."""

    def __init__(self, settings: PoolSettings | None = None):
        self.settings = settings or PoolSettings()
        self.chromium = find_chromium(self.settings.executable)
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-browser-"))
        self._wrapper = self._dir / "chromium"
        self._wrapper.write_text(WRAPPER.format(python=sys.executable, chromium=self.chromium))
        self._wrapper.chmod(0o700)
        self._dead = socket.socket()  # bound, never listening: the dead proxy's port
        self._dead.bind(("127.0.0.1", 0))
        self.server = TaskServer()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="browser-pool", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._sessions: set[Session] = set()
        try:
            self._call(self._start()).result()
        except BaseException:
            self.close()
            raise
        _POOLS.append(self)

    async def _start(self) -> None:
        from playwright.async_api import async_playwright

        n = self.settings.browsers
        self._slots = [_Slot(i) for i in range(n)]
        self._free = asyncio.Semaphore(n * self.settings.contexts_per_browser)
        self._pw = await async_playwright().start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def _call(self, coro: Coroutine[Any, Any, T]) -> Any:
        if self._closed:
            coro.close()
            raise BrowserError("the browser pool is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the pool's loop; await its result from any loop."""
        return await asyncio.wrap_future(self._call(coro))

    # -- browsers ---------------------------------------------------------------------

    def launch_args(self) -> list[str]:
        port, dead = self.server.port, self._dead.getsockname()[1]
        return [
            f"--proxy-server=http://127.0.0.1:{dead}",
            f"--proxy-bypass-list=<-loopback>;127.0.0.1:{port}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
            "--webrtc-ip-handling-policy=disable_non_proxied_udp",
            "--disable-background-networking", "--disable-component-update",
            "--disable-domain-reliability", "--disable-sync", "--disable-extensions",
            "--no-first-run", "--no-default-browser-check", "--disable-breakpad",
            "--disable-gpu", "--disable-dev-shm-usage", "--mute-audio",
            f"--renderer-process-limit={self.settings.contexts_per_browser + 1}",
        ]  # fmt: skip

    async def _ensure(self, slot: _Slot) -> Any:
        async with slot.lock:
            if slot.browser is not None and slot.browser.is_connected():
                return slot.browser
            self._kill_slot(slot)
            slot.launches += 1
            pidfile = self._dir / f"slot{slot.index}-{slot.launches}.pid"
            env = {**os.environ, "ASYNCRL_BROWSER_PIDFILE": str(pidfile)}
            slot.browser = await self._pw.chromium.launch(
                executable_path=str(self._wrapper), args=self.launch_args(), env=env,
                headless=True, handle_sigint=False, handle_sigterm=False, handle_sighup=False,
            )  # fmt: skip
            slot.pid = int(pidfile.read_text()) if pidfile.exists() else 0
            return slot.browser

    def _kill_slot(self, slot: _Slot) -> None:
        """SIGKILL the slot's Chromium and its process group (renderers, zygote)."""
        if slot.pid:
            for kill in (os.killpg, os.kill):
                try:
                    kill(slot.pid, signal.SIGKILL)
                except OSError:
                    pass
        slot.browser, slot.pid = None, 0

    def browser_pids(self) -> list[int]:
        """The pids of the running Chromium browser processes (one per launched slot)."""
        return [s.pid for s in getattr(self, "_slots", []) if s.pid]

    # -- sessions ---------------------------------------------------------------------

    async def open(self, site: Site) -> Session:
        """A fresh context on the least busy browser, showing ``site``'s start page."""
        return await self.run(self._open(site))

    async def _open(self, site: Site) -> Session:
        await self._free.acquire()
        slot = min(self._slots, key=lambda s: s.sessions)
        slot.sessions += 1
        s = Session(token=uuid.uuid4().hex, site=site, slot=slot)
        s.deadline = time.monotonic() + self.settings.episode_timeout_s
        self._sessions.add(s)
        self.server.add(s.token, site)
        try:
            s.browser = browser = await self._ensure(slot)
            # each call bounded like an action: a browser killed meanwhile is an error
            # within action_timeout_s, not an episode waiting out its whole timeout
            s.context = await self.guard(
                s, browser.new_context(service_workers="block", java_script_enabled=True)
            )
            s.context.set_default_timeout(self.settings.action_timeout_s * 1000 / 2)
            await self.guard(s, s.context.route("**/*", lambda route: self._route(s, route)))
            s.page = await self.guard(s, s.context.new_page())
            await self.guard(s, s.page.goto(self.server.url(s.token, site["start"])))
            await self.guard(s, s.page.evaluate(WALK_JS))  # the start page's element ids
        except BaseException:
            await self._close(s)
            raise
        return s

    async def _route(self, s: Session, route: Any) -> None:
        url = route.request.url
        if url.startswith(self.server.prefix(s.token)):
            await route.continue_()
        else:
            s.refused.append(url)
            await route.abort("blockedbyclient")

    async def guard(self, s: Session, coro: Coroutine[Any, Any, T]) -> T:
        """Await a Playwright call of ``s`` within ``action_timeout_s``: a hang closes the
        session (its browser killed if the close hangs too); a dead browser raises."""
        if s.closed:
            coro.close()
            why = "episode over env.episode_timeout_s" if s.expired else "session closed"
            raise BrowserError(why)
        try:
            return await asyncio.wait_for(coro, self.settings.action_timeout_s)
        except TimeoutError:
            await self._close(s)
            raise BrowserError(
                f"page hung: no answer within env.action_timeout_s={self.settings.action_timeout_s}"
            ) from None
        except Exception as e:
            if s.page is None or s.page.is_closed() or not s.browser.is_connected():
                await self._close(s)
                raise BrowserError(f"browser gone: {type(e).__name__}: {e}") from None
            raise

    def release(self, s: Session) -> None:
        """Close ``s`` from any thread, without waiting (a no-op once closed)."""
        if s.closed or self._closed or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._close(s)))
        except RuntimeError:  # the loop stopped meanwhile
            pass

    async def close_session(self, s: Session) -> None:
        await self.run(self._close(s))

    async def _close(self, s: Session) -> None:
        if s.closed:
            return
        s.closed = True
        self._sessions.discard(s)
        self.server.remove(s.token)
        s.slot.sessions -= 1
        self._free.release()
        if s.context is None:
            return
        try:
            await asyncio.wait_for(s.context.close(), CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a context that will not close: kill its browser
            if s.slot.browser is s.browser:  # not one relaunched since
                self._kill_slot(s.slot)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            for s in [s for s in self._sessions if s.deadline < now]:
                s.expired = True
                await self._close(s)

    # -- shutdown ---------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._reaper.cancel()
        for s in list(self._sessions):
            await self._close(s)
        for slot in self._slots:
            if slot.browser is not None:
                try:
                    await asyncio.wait_for(slot.browser.close(), CLOSE_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - killed below either way
                    pass
            self._kill_slot(slot)
        await asyncio.wait_for(self._pw.stop(), CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Close every context and browser, kill what is left, stop the server."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_pw"):
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
            except Exception:  # noqa: BLE001 - kill what is left below
                pass
        for slot in getattr(self, "_slots", []):
            self._kill_slot(slot)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.server.close()
        self._dead.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_POOLS: list[BrowserPool] = []
_SHARED: dict[PoolSettings, BrowserPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(settings: PoolSettings) -> BrowserPool:
    """This process's pool for ``settings`` (built on first use, shared by its episodes)."""
    with _SHARED_LOCK:
        pool = _SHARED.get(settings)
        if pool is None or pool._closed:
            pool = _SHARED[settings] = BrowserPool(settings)
        return pool


@atexit.register
def close_all() -> None:
    """Close every pool of this process (at exit, and after SIGINT's KeyboardInterrupt)."""
    for pool in list(_POOLS):
        pool.close()
    _POOLS.clear()
    _SHARED.clear()
