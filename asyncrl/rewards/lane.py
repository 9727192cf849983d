"""Where a reward component's code runs, and the fence around it: nothing a component
does (raise anything, ``SystemExit`` and ``KeyboardInterrupt`` included, or block
synchronously) reaches the loop that scores with it, a reward worker's or, on the fast
path, the rollout actor's.

::

    caller's loop                                  the component's lane: a daemon thread
      Lane.call(fn, timeout_s)                     with its own event loop, running every
        ──run_coroutine_threadsafe(guarded(fn))──▶ call of this one component
        wait_for(.., timeout_s)                      guarded(fn): fn() (awaited if a
        ◀── fn's result, or ComponentFailed ──────   coroutine); any BaseException but
      on timeout: ComponentFailed at once; the       the task's own cancellation becomes
      call is cancelled on the lane when its loop    ComponentFailed(reason)
      next runs

A component that blocks its lane (``time.sleep``, a blocking socket) stalls only its
own later calls, which time out in turn; the caller's loop never waits on it. One lane
per component keeps a component's asyncio objects on one loop, as they would be on the
caller's. A component with ``timeout_s = inf`` declares it never waits
(:class:`asyncrl.rewards.task.TaskReward`): it runs :func:`guarded` on the caller's loop,
no thread hop, exceptions still fenced. Not contained: ``os._exit``, a crash of the
interpreter, a thread the component starts itself (reward code is trusted to that extent,
docs/rewards.md).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
REASON_CHARS = 300  # a reason is one line of an error string on each episode it failed
CLOSE_WAIT_S = 5.0  # for the calls still on a closing lane to take their cancellation


class ComponentFailed(Exception):
    """A component's call failed; ``str(e)`` is the reason recorded on its episodes."""


def describe(e: BaseException) -> str:
    """``Type: message`` on one line, clipped; never raises (a message's ``__str__`` is
    the component's code too)."""
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001 - an exception whose message cannot be printed
        text = "<unprintable message>"
    out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return out if len(out) <= REASON_CHARS else out[: REASON_CHARS - 3] + "..."


async def guarded(fn: Callable[[], T]) -> T:
    """``fn()``, awaited if it returns an awaitable; whatever it raises becomes
    :class:`ComponentFailed`, except the cancellation of the task running it (a
    timeout's, or the caller's), which propagates."""
    try:
        out = fn()
        if inspect.isawaitable(out):
            out = await out
        return out
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ComponentFailed("CancelledError raised by the component") from None
    except BaseException as e:  # noqa: BLE001 - SystemExit from a reward must not end the actor
        raise ComponentFailed(describe(e)) from None


class Lane:
    """One component's thread and event loop, started on the first call."""

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` on the lane, within ``timeout_s``; raises only ComponentFailed (or
        the caller's own cancellation)."""
        if self._closing:
            raise ComponentFailed("its lane is closed")
        if self._loop is None:
            self._start()
        assert self._loop is not None
        done = asyncio.run_coroutine_threadsafe(guarded(fn), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)
        except TimeoutError:
            raise ComponentFailed(f"timed out after {timeout_s:g} s") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            raise ComponentFailed("cancelled on its lane (the lane closed)") from None

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        name = f"reward-lane-{self.name}"
        threading.Thread(target=self._serve, args=(self._loop,), name=name, daemon=True).start()

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        while not self._closing:
            try:
                loop.run_forever()
            except BaseException:  # noqa: BLE001, S112 - a task the component made raised SystemExit
                continue
        pending = asyncio.all_tasks(loop)  # cancelled, not left for the collector to close
        for t in pending:
            t.cancel()
        if pending:
            try:
                loop.run_until_complete(asyncio.wait(pending, timeout=CLOSE_WAIT_S))
            except BaseException:  # noqa: BLE001, S110 - closing is best effort
                pass
        loop.close()

    def close(self) -> None:
        """Stop the lane's loop (a lane blocked in a component stops when it returns)."""
        self._closing = True
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:  # already closed
                pass
