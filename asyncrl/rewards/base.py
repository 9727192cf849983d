"""The reward contract: what a user writes to score finished episodes.

A reward component is a :class:`Reward` subclass built from the ``reward.components``
config list (``_target_`` + its constructor kwargs, ``weight`` taken off by the
combiner). The built-ins (asyncrl/rewards/task.py, shaping.py, the judge and the reward
model) use exactly the same path::

    class MyReward(Reward):
        name = "mine"                       # logged as reward/mine
        async def score(self, batch):       # list[RewardInput] -> list[RewardOutput]
            return [RewardOutput(value=float(len(x.response) < 100)) for x in batch]

* ``score`` is a coroutine, awaited in a reward worker (a Ray actor off the generation
  path, asyncrl/rewards/pool.py) on the component's own thread and event loop
  (asyncrl/rewards/lane.py) or, for the env's own reward only, on the rollout actor's
  loop. Anything slow is awaited, never run inline.
* One output per input, in order. A call that raises, times out (``timeout_s``) or
  answers the wrong number of outputs or a wrong type is an error on each episode of
  the call (BaseExceptions and a ``score`` that blocks included): the episode then
  scores ``reward.on_error`` for this component and the error is recorded on its
  trajectory, never raised (asyncrl/rewards/combine.py).
* ``max_batch``: the pool hands over at most this many episodes per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardInput:
    """One finished episode, as a reward sees it."""

    prompt: str  # the prompt text as the policy saw it (rendered)
    response: str  # the policy's text (all generated turns joined, observations excluded)
    response_ids: list[int]  # the generated token ids (mask 1 tokens)
    answer: Any  # the task sample's reference answer (may be None)
    info: dict[str, float]  # the env's info / breakdown (env rewards under their keys)
    env_reward: float  # the env's own reward for the episode (the task reward today)
    task: str = ""  # task name, for mixtures


@dataclass
class RewardOutput:
    """One component's score of one episode."""

    value: float  # this component's score
    components: dict[str, float] = field(default_factory=dict)  # sub-scores: reward/<name>/<key>
    error: str = ""  # "" if fine; else why (the value is then the failure policy's)


class Reward:
    """Base class of a reward component (see the module docstring)."""

    name: str = "reward"  # metric name: reward/<name>
    max_batch: int = 64  # the pool hands over at most this many episodes per call
    timeout_s: float = 30.0  # per call; a timeout is an error on each episode of the call

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        """One output per input, in order."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    async def close(self) -> None:
        """Free engines/actors (optional)."""
        return None
