"""A rollout actor's generation slots, as its outbox sees them (replay/outbox.py
``SlotAsker``), and what the queue learns of a group without reading it.

    slot: free ──ask()──▶ asking ──answered(granted)──▶ generating (inflight) ──▶ free
          (the actor's loop asks with acquire_many; each hand-off asks with its groups)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncrl.replay.buffer import GroupMeta
from asyncrl.trajectory import TrajectoryGroup

# The loop asks the queue for slots once 1/REFILL_SHARE of them are free, not one by
# one: each ask is a Ray call, and a steady actor gets its slots back with its hand-offs.
REFILL_SHARE = 4


class Slots:
    """One actor's ``max_inflight`` slots: ``inflight`` groups generating, ``asking``
    reserved for queue calls not yet answered, the rest free. ``on_granted(n)``: the
    actor starts ``n`` granted groups (or gives them back once halted). A plain object,
    not methods of the Ray actor: nobody may call these remotely."""

    def __init__(self, name: str, max_inflight: int, on_granted: Callable[[int], None]):
        self.name = name
        self.max_inflight = max_inflight
        self.refill = max(1, max_inflight // REFILL_SHARE)  # the loop asks once this many are free
        self.inflight = 0
        self.scoring = 0  # of the inflight groups, those generated and being scored
        self.asking = 0
        self.running = False  # the actor's loop runs: slots may be asked for
        self.freed = asyncio.Event()  # a slot was freed or answered: the loop looks again
        self._on_granted = on_granted

    def free(self) -> int:
        """Slots neither generating nor asked for."""
        return self.max_inflight - self.inflight - self.asking

    def ask(self) -> int:
        """Reserve every free slot for one queue call (0 once halted)."""
        k = max(0, self.free()) if self.running else 0
        self.asking += k
        return k

    def answered(self, asked: int, granted: int) -> None:
        """A queue call's answer: ``granted`` of ``asked`` slots go to the actor."""
        self.asking -= asked
        if granted:
            self._on_granted(granted)
        self.freed.set()

    def scoring_changed(self, delta: int) -> bool:
        """A group's scoring began (+1) or ended (-1); True when a lingering hand-off
        should look again (the group was the last one generating)."""
        self.scoring += delta
        return delta > 0 and not self.worth_lingering()

    def outbox_idle(self) -> None:
        """The outbox has nothing in flight: the loop may ask for slots itself again."""
        self.freed.set()

    def worth_lingering(self) -> bool:
        """Whether a hand-off may wait for more groups: some are still generating (groups
        being scored do not count: a slow reward answers when it answers, and the learner
        may be waiting for the groups that would linger), and fewer than a quarter of the
        slots wait to be asked for again. The slots of finished groups are asked for with
        their hand-off, so each group that lingers is one the engine does not have queued
        (with 2-3-token answers a fast CPU engine finished about 30 groups in one 100 ms
        linger)."""
        return self.inflight > self.scoring and self.free() < self.refill


def group_meta(group: TrajectoryGroup, actor: str) -> GroupMeta:
    ts = group.trajectories
    return GroupMeta(
        group_id=group.group_id,
        traj_ids=[t.traj_id for t in ts],
        min_versions=[t.min_version for t in ts],
        num_tokens=[t.num_tokens for t in ts],
        rewards=[t.reward for t in ts],
        actor=actor,
    )
