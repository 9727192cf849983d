"""What the driver's loop sees of a weight broker, whichever kind runs.

    loop: train step V ─▶ broker.publish(V+1) ─▶ (the sync runs in the background)
          ...           ─▶ broker.wait() when a step must see the sync done
    end:  broker.close()

A broker takes the weights from the learner itself (the driver passes only the
version), keeps every actor's loaded version, and reports each finished sync's
``broker/*`` metrics with the next ``publish`` or ``wait``. Errors it met are logged in
the driver as they come back with those calls; ``state()`` holds them all.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class BrokerError(RuntimeError):
    """A weight sync cannot go on (every actor dead, a deadline missed)."""


@runtime_checkable
class Broker(Protocol):
    def publish(self, version: int) -> dict[str, float]:
        """Start syncing the learner's current weights as ``version`` (greater than any
        before); returns the previous sync's metrics (``{}`` if none)."""
        ...

    def wait(self) -> dict[str, float]:
        """Block until the sync in flight is done; its metrics (``{}`` if none)."""
        ...

    def state(self) -> dict[str, Any]:
        """At least ``version``, ``actor_versions`` (name -> loaded version), ``dead``
        (name -> why) and ``errors`` (every error message so far)."""
        ...

    def close(self) -> None:
        """Finish the sync in flight and release what the broker holds."""
        ...
