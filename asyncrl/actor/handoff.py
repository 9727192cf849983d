"""The rollout actor's side of its outbox (replay/queue.py): the slot answers each
hand-off carries, and what the queue learns of a group without reading it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.replay.buffer import GroupMeta
from asyncrl.trajectory import TrajectoryGroup

if TYPE_CHECKING:
    from asyncrl.actor.rollout import RolloutActor


class HandOffSlots:
    """The actor's answers to its outbox (replay/queue.py ``SlotAsker``): each hand-off
    also asks for the slots free by then. Not methods of the actor itself, which is a
    Ray actor: nobody may call these remotely."""

    def __init__(self, actor: RolloutActor):
        self.actor = actor
        self.name = actor.name

    def ask(self) -> int:
        return self.actor._ask()

    def answered(self, asked: int, granted: int) -> None:
        self.actor._answered(asked, granted)

    def outbox_idle(self) -> None:
        self.actor._slot_freed.set()  # the loop may ask for slots itself again

    def worth_lingering(self) -> bool:
        return self.actor._worth_lingering()


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
