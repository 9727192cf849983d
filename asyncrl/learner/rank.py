"""The Ray actor class of one learner rank: :class:`LearnerRank`, made remote by
:class:`~asyncrl.learner.group.LearnerGroup` with the broker's ``CONCURRENCY_GROUPS``
(asyncrl/broker/messages.py).

Ray imports an actor's class module in every process where a handle to the actor is
deserialised: the broker, the evaluator and the fault supervisor hold the ranks'
handles. This module imports no torch, so those processes do not load torch and the
learner's code (~5 s of a core each, while the engines start); the rank builds its
:class:`~asyncrl.learner.learner.Learner` in its own process.

Each method is the Learner's of the same name and signature, called on the rank's
Learner (``learner``); the broker's transfers (``send_weights``, ``close_send_groups``)
run in the ``weights`` concurrency group, beside a train step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray

from asyncrl.broker.messages import WEIGHTS_GROUP

if TYPE_CHECKING:
    import torch

    from asyncrl.broker.messages import (
        Attached,
        CloseGroups,
        SendDone,
        SendOrder,
        Snapshot,
        SnapshotOrder,
    )
    from asyncrl.broker.settings import BrokerSettings
    from asyncrl.learner.batch import TrainBatch
    from asyncrl.learner.learner import Learner


class LearnerRank:
    """One learner rank as a Ray actor: ``Learner(*args, **kwargs)`` built in its process."""

    def __init__(self, *args: Any, **kwargs: Any):
        from asyncrl.learner.learner import Learner

        self.learner: Learner = Learner(*args, **kwargs)

    # ---- steps, checkpoints, checks ---------------------------------------------------
    def train_step(self, items: list, version: int) -> dict[str, float]:
        return self.learner.train_step(items, version)

    def step_on_batch(self, batch: TrainBatch, version: int) -> dict[str, float]:
        return self.learner.step_on_batch(batch, version)

    def save(self, path: str, driver_state: dict | None = None, export_hf: bool = True) -> str:
        return self.learner.save(path, driver_state, export_hf)

    def load(self, path: str) -> dict[str, Any]:
        return self.learner.load(path)

    def logprobs_of(self, trajs: list, version_check: bool = False) -> list | None:
        return self.learner.logprobs_of(trajs, version_check)

    def ping(self) -> bool:
        return self.learner.ping()

    def pid(self) -> int:
        return self.learner.pid()

    def close(self) -> None:
        self.learner.close()

    # ---- weights out (learner/weights.py) ---------------------------------------------
    def stream_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.learner.stream_weights()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.learner.full_state_dict()

    def attach_broker(
        self, broker_id: str, broker: Any, settings: BrokerSettings, shard: int = 0
    ) -> Attached:
        return self.learner.attach_broker(broker_id, broker, settings, shard)

    def snapshot_weights(self, order: SnapshotOrder) -> Snapshot | None:
        return self.learner.snapshot_weights(order)

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def send_weights(self, order: SendOrder) -> SendDone:
        return self.learner.send_weights(order)

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def close_send_groups(self, order: CloseGroups) -> None:
        self.learner.close_send_groups(order)

    def detach_broker(self) -> None:
        self.learner.detach_broker()

    def weight_digests(self) -> dict[str, str]:
        return self.learner.weight_digests()

    def shard_digests(self, tp: int, index: int | None = None) -> dict[str, Any]:
        return self.learner.shard_digests(tp, index)

    def weights_ref(self) -> dict[str, Any] | None:
        return self.learner.weights_ref()
