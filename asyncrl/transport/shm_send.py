"""The sender's half of the same-host road (asyncrl/transport/shm.py): :class:`ShmRoad`.

:class:`~asyncrl.transport.broadcast.WeightSender` holds one per group and asks it, per
sync::

    usable(held_hosts)  every receiver posted this host's identity, the group runs gloo?
                        (a change of answer is logged once)
    refs(plans)         per bucket [segment, offset, bytes] for the header: the shadow's own
                        segment (dense), a segment staged for this sync (sparse), or None
                        (skipped, or no segment: the wire carries it)
    await_reads(seq)    every receiver claimed read/<seq>, or the sync fails, abandoning
                        the receivers that did not claim it
    unstage()           this sync's staged segments unlinked
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch

from asyncrl.transport.buckets import PackedModel
from asyncrl.transport.delta import BucketPlan, Kind
from asyncrl.transport.group import Heartbeat, TransferGroup, silent_ranks
from asyncrl.transport.shm import ShmArena, host_identity
from asyncrl.transport.spec import HEADER_BUCKET
from asyncrl.transport.wire import ABANDONED

log = logging.getLogger(__name__)

# A bucket's place on the same-host road: [segment name, byte offset, bytes], or None
# where the bucket goes over the wire (or is skipped).
ShmRefs = list[list | None]
# How often the sender looks at the receivers' claims and heartbeats while they read
# shared memory (the store's wait wakes at once when every claim is there).
ACK_POLL_S = 0.5


def any_shm(refs: ShmRefs | None) -> bool:
    """Whether any bucket of a sync is read from shared memory."""
    return refs is not None and any(r is not None for r in refs)


class ShmRoad:
    """One group's same-host road, on the sender: ``arena`` holds the shadows' buckets
    (None: the road is never taken)."""

    def __init__(self, group: TransferGroup, arena: ShmArena | None):
        self.group = group
        self.arena = arena
        self._said: str | None = None  # the last decision logged
        # this sync's own segments (sparse payloads), held so they live until unstaged
        self._staged: list[tuple[str, torch.Tensor]] = []

    def usable(self, held_hosts: dict[int, str]) -> bool:
        """Whether this sync may use shared memory (``held_hosts``: rank -> the host
        identity it posted); a change of answer is logged once."""
        if self.arena is None:
            return False
        me = host_identity()
        away = sorted(r for r, h in held_hosts.items() if not me or h != me)
        if self.group.backend != "gloo":
            why: str | None = (
                f"the group runs {self.group.backend}, shared memory is for CPU buckets"
            )
        elif away:
            why = f"receiver rank(s) {away} are not provably on this host (host identity differs)"
        else:
            why = None
        said = why or "shared memory"
        if said != self._said:
            self._said = said
            if why is None:
                log.info(
                    "weight sync (port %d): shared memory, receivers on this host", self.group.port
                )
            else:
                log.warning("weight sync (port %d): over %s, not shared memory: %s",
                            self.group.port, self.group.backend, why)  # fmt: skip
        return why is None

    def refs(
        self,
        packed: PackedModel,
        plans: list[BucketPlan],
        encode: Callable[[int, BucketPlan], torch.Tensor],
    ) -> ShmRefs:
        """Per bucket, where a receiver reads its payload: the shadow's own segment (dense),
        or a segment staged for this sync holding ``encode(i, plan)`` (sparse); None for
        skipped buckets and buckets without a segment (they go over the wire)."""
        assert self.arena is not None
        out: ShmRefs = []
        for i, plan in enumerate(plans):
            ref = None
            if plan.kind is Kind.DENSE and plan.nbytes > 0:
                seg = self.arena.segment_of(packed.buckets[i])
                ref = [seg[0], 0, seg[1]] if seg is not None else None
            elif plan.kind is Kind.SPARSE and plan.nbytes > 0:
                staged = self.arena.stage(encode(i, plan))
                if staged is not None:
                    self._staged.append(staged)
                    ref = [staged[0], 0, plan.nbytes]
            out.append(ref)
        return out

    def unstage(self) -> None:
        """Unlink this sync's staged segments (receivers that mapped one keep it)."""
        if self.arena is not None:
            for name, _ in self._staged:
                self.arena.drop(name)
        self._staged = []

    def await_reads(self, seq: int, progress: dict[str, int], hb: Heartbeat | None) -> None:
        """Wait until every receiver claimed sync ``seq`` as read (``read/<seq>/<rank>``,
        posted once it holds every segment's bytes); raises when one reports a failure,
        goes silent or the group's timeout passes. Giving up abandons the receivers that
        have not claimed it (the same key, atomically), so a late one fails instead of
        finishing a sync the sender reported failed; ``progress`` then names the bucket
        the first of them was at (``at/<seq>/<rank>``)."""
        g = self.group
        pending = {r: g.key("read", seq, r) for r in range(1, g.world_size)}
        deadline = time.monotonic() + g.timeout_s
        if hb is not None:
            hb.enter("wait")
        try:
            while pending:
                try:
                    g.store.wait(list(pending.values()), datetime.timedelta(seconds=ACK_POLL_S))
                    return
                except Exception:  # noqa: BLE001 - the store's timeout; a broken store fails below
                    pass
                pending = {r: k for r, k in pending.items() if not g.has(k)}
                if not pending:  # every claim came in after the wait timed out
                    return
                problem = self._problem(seq, pending, deadline)
                if problem is None:
                    continue
                late = self._abandon(pending)
                if not late:  # every one claimed it in the meantime
                    return
                at = [g.store.get(g.key("at", seq, r)) for r in late if g.has(g.key("at", seq, r))]
                progress["bucket"] = min((int(b) for b in at), default=HEADER_BUCKET)
                raise RuntimeError(problem)
        finally:
            if hb is not None:
                hb.enter("work")

    def _problem(self, seq: int, pending: dict[int, str], deadline: float) -> str | None:
        """Why the wait for ``pending`` receivers must end now (None: keep waiting)."""
        g = self.group
        failed = [r for r in pending if g.has(g.key("fail", seq, r))]
        if failed:
            why = g.store.get(g.key("fail", seq, failed[0])).decode()
            return f"receiver(s) {failed} failed reading shared memory: {why}"
        silent = silent_ranks(g, seq, pending)
        if silent:
            return f"receiver(s) {silent} went silent reading shared memory"
        if time.monotonic() > deadline:
            return f"receiver(s) {sorted(pending)} did not finish within {g.timeout_s:.1f}s"
        return None

    def _abandon(self, pending: dict[int, str]) -> list[int]:
        """Mark every still-pending receiver's claim ``abandoned`` unless it claimed the
        sync first; returns the abandoned ranks."""
        g = self.group
        out = []
        for r, key in pending.items():
            if g.store.compare_set(key, "", ABANDONED).decode() == ABANDONED:
                out.append(r)
        return sorted(out)
