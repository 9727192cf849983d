"""Who receives what, decided from every actor's versions (pure: no Ray, no torch).

A *sync set* is the actors that receive one broadcast together: they must hold
the same base version (a delta is against exactly that version), so actors
are grouped by the version of their held copy. ``rolling_k > 0`` splits the
actors that need an update into waves of at most ``k``: a wave transfers and
reloads while every other actor keeps generating, and the next wave starts
when it is done. Most stale actors go first.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.transport.spec import NO_VERSION


@dataclass(frozen=True)
class SyncSet:
    """Actors that get ``version`` in one broadcast, all holding ``base`` now."""

    members: tuple[str, ...]
    base: int


@dataclass
class ActorView:
    """What the broker knows of one actor: ``loaded`` labels its tokens, ``held``
    is the copy its workers keep for deltas (``NO_VERSION``: none), ``workers``
    its vLLM worker processes (tensor/pipeline parallel ranks)."""

    loaded: int
    held: int = NO_VERSION
    workers: int = 1
    failures: int = 0  # consecutive failed syncs
    update_mode: str = "keep"  # what its engine does with requests in flight (wait: drains)


def plan_waves(
    actors: dict[str, ActorView], version: int, rolling_k: int, only_stale: bool = True
) -> list[list[SyncSet]]:
    """Waves of sync sets bringing every actor whose loaded version is not
    ``version`` up to it (every actor, without ``only_stale``). Within a wave,
    one set per held version."""
    need = sorted(
        (n for n, a in actors.items() if a.loaded != version or not only_stale),
        key=lambda n: (actors[n].loaded, n),
    )
    if not need:
        return []
    k = rolling_k if rolling_k > 0 else len(need)
    waves = []
    for i in range(0, len(need), k):
        by_base: dict[int, list[str]] = {}
        for n in need[i : i + k]:
            by_base.setdefault(actors[n].held, []).append(n)
        waves.append([SyncSet(tuple(sorted(m)), base) for base, m in sorted(by_base.items())])
    return waves


def ranks_of(
    members: tuple[str, ...], actors: dict[str, ActorView], senders: int = 1
) -> tuple[dict[str, int], int]:
    """First rank of each member's workers and the world size. Ranks ``0..senders-1``
    are the learner's: rank 0 alone, or the ranks each sending their own engine shard."""
    ranks, nxt = {}, senders
    for n in members:
        ranks[n] = nxt
        nxt += actors[n].workers
    return ranks, nxt
