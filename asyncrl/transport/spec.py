"""The plain messages of one weight sync's receiving end: where a worker joins a group
(:class:`JoinSpec`) and what it reports back (:class:`ReceiveReport`). Plain values
(they cross vLLM's RPC as dicts) in a module that imports no torch, so the actor's
and the queue's processes can name them without loading it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_VERSION = -1  # what a receiver holding no weights reports
HEADER_BUCKET = -1  # bucket index used in errors raised before any bucket moved


@dataclass(frozen=True)
class JoinSpec:
    """Where one worker takes part in a group's next sync (plain values: it crosses
    vLLM's RPC encoding as a dict, :meth:`from_wire` rebuilds it)."""

    key: str
    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float
    join_timeout_s: float
    backend: str = "auto"
    hold_copy: bool = True
    kind: str = "join"

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> JoinSpec:
        return cls(**d)


@dataclass
class ReceiveReport:
    """One worker's end of one sync: received and loaded (``ok``), or the error with
    the failing peer ranks and ``bucket`` (None: before any bucket, e.g. joining).
    ``held``: the version kept for deltas; ``digests`` only when asked for."""

    ok: bool
    rank: int
    version: int = NO_VERSION
    held: int = NO_VERSION
    bytes: int = 0
    seconds: float = 0.0  # join + receive
    reload_seconds: float = 0.0  # the in-place load alone
    error: str = ""
    bucket: int | None = None
    peer_ranks: tuple[int, ...] = ()
    digests: dict[str, str] | None = None
    kind: str = "received"

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ReceiveReport:
        return cls(**{**d, "peer_ranks": tuple(d.get("peer_ranks") or ())})
