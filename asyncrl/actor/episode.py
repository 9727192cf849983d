"""What one episode is: the seam between the rollout actor's slot loop
(actor/rollout.py) and what it generates for one prompt.

    actor:  prompt ─▶ EpisodeRunner.run_group(prompt) ─▶ TrajectoryGroup ─▶ outbox
    SingleTurnEpisodes.run_group:
            engine.generate(prompt, n samples) ─▶ decode each completion once
            ─▶ score it with the task's reward (the env's reward) ─▶ one Trajectory per
            completion ─▶ await the reward components (asyncrl/rewards/pool.py: in-process
            for the task's reward alone, else on the reward workers)

The contract every runner keeps (the learner and the queue rely on it):

* Token ids are the engine's own (``prompt_ids``, ``response_ids``), never text
  tokenized again: an episode of several turns builds them turn by turn.
* ``behaviour_logprobs[i]`` is the log-prob of ``response_ids[i]`` under the
  distribution the engine sampled it from (after temperature / top-k / top-p:
  ``asyncrl.engine.protocol.Completion``).
* ``versions[i]`` is the policy version of the weights that produced token ``i``,
  as the engine labels it (a sequence may span a weight update).
* A prompt's images (``Prompt.meta["images"]``, PNG bytes) go to the engine with it;
  ``prompt_ids`` hold the placeholder tokens the engine expanded them into (never
  trained: only ``response_ids`` carry ``loss_mask``), and every sample of the group
  shares the same ``Trajectory.images``. An observation's images (a multi-turn env's
  ``StepResult.images``) follow them in ``Trajectory.images``, their expanded tokens in
  ``response_ids`` with ``loss_mask`` False.
* ``loss_mask[i]`` is True for tokens the policy generated, False for tokens it did
  not (an environment's observation, a tool's output): the learner trains on the
  first only.
* A reward that fails is a recorded outcome, never a raised error: ``reward.on_error``
  (0) for the failed component and ``Trajectory.error`` set (the actor counts them as
  ``reward_errors``).
* An episode that a weight update under ``actor.update_mode=abort`` cut short
  raises :class:`EpisodeAborted`: the actor runs the prompt again, so every
  trajectory is produced by complete generation. Any other exception fails the
  group (the actor records it and frees its queue slot).
* ``run_group`` awaits everything slow (the engine, an environment, a reward
  service): it shares the actor's event loop with every other episode in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from asyncrl.engine.protocol import (
    Completion,
    Engine,
    Sampling,
    group_sampling,
    policy_sampling,
    version_salt,
)
from asyncrl.engine.settings import SamplingSettings
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.pool import RewardClient
from asyncrl.tasks.base import Prompt, Task, ascore, score
from asyncrl.trajectory import Image, Trajectory, TrajectoryGroup


class EpisodeAborted(Exception):
    """A weight update aborted the episode's requests: run it again from its prompt."""


class EpisodeRunner(Protocol):
    """Turns one prompt into one group of trajectories (the contract above)."""

    async def run_group(self, prompt: Prompt) -> TrajectoryGroup: ...


class SingleTurnEpisodes:
    """One ``engine.generate(prompt, n)`` call; each completion is one trajectory,
    scored by the task's reward as soon as the group is generated.

    ``version()`` is the version the engine's weights carry now: each request's cache
    salt."""

    def __init__(
        self,
        engine: Engine,
        task: Task,
        sampling: SamplingSettings,
        version: Callable[[], int],
        rewards: RewardClient | None = None,  # None: the task's reward, in-process
    ):
        self.engine = engine
        self.task = task
        self.rewards = rewards or RewardClient()
        self.n = sampling.n
        self.version = version
        self.sampling = policy_sampling(sampling)  # the same for every group, but its seed
        self._groups = 0  # groups started so far: each samples from its own seed (group_sampling)
        self._tokenizer = None  # the engine's, on first use

    async def run_group(self, prompt: Prompt) -> TrajectoryGroup:
        # The group's place in the start order leads its id, so that a consumer can put a
        # batch back in a run-independent order (the staleness benchmark does).
        gid = f"{self._groups:08x}{uuid.uuid4().hex[:16]}"
        t_start = time.time()
        sampling = group_sampling(self.engine, self.sampling, self._groups)  # before any await
        self._groups += 1
        # salted with the version the engine's weights carry now (version_salt): it
        # reuses cached KV of that version only
        # a prompt's images (PNG bytes): one Image each, shared by the group's samples
        pngs = prompt.meta.get("images")
        images = [Image.of(png) for png in pngs] if pngs else []
        kw = {"images": [im.png for im in images]} if images else {}
        rid, salt = gid + "-" + uuid.uuid4().hex[:6], version_salt(self.version())
        out = await self.engine.generate(prompt.text, sampling, rid, salt, **kw)
        comps = out.completions
        if len(comps) != self.n or out.aborted:
            raise EpisodeAborted(f"group {gid}: a weight update aborted its requests")
        prompt_ids = np.asarray(out.prompt_ids, dtype=np.int32)  # one per group
        trajs, inputs = [], []
        texts = self.texts(comps)
        # a task that grades in other processes (the code task's sandboxes) grades the
        # group's completions concurrently; a pure reward is called directly
        if getattr(self.task, "areward", None) is None:
            scored = [score(self.task, prompt, t) for t in texts]
        else:
            scored = await asyncio.gather(*(ascore(self.task, prompt, t) for t in texts))
        for i, (c, text, (reward, breakdown, err)) in enumerate(zip(comps, texts, scored)):
            ids = c.token_ids
            trajs.append(
                Trajectory(
                    traj_id=f"{gid}-{i}",
                    group_id=gid,
                    prompt_ids=prompt_ids,
                    response_ids=ids,
                    behaviour_logprobs=c.logprobs,
                    versions=c.versions,
                    loss_mask=np.ones(len(ids), dtype=bool),
                    reward=reward,
                    reward_breakdown=breakdown,
                    finish_reason=str(c.finish_reason),
                    error=err,
                    prompt_text=prompt.text,
                    response_text=text,
                    t_start=t_start,
                    t_end=time.time(),
                    images=images,
                    routed_experts=c.routed_experts,
                )
            )
            inputs.append(reward_input(self.task, prompt, text, ids, breakdown, reward))
        await self.rewards.apply(trajs, inputs)
        return TrajectoryGroup(gid, trajs)

    def texts(self, comps: list[Completion]) -> list[str]:
        """Each completion's text, decoded here once per completion (the engine is
        asked not to detokenize): what vLLM's own detokenizer gives, specials left out."""
        if self._tokenizer is None:
            self._tokenizer = self.engine.get_tokenizer()
        return [
            self._tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in comps
        ]


def reward_input(
    task: Task, prompt: Prompt, text: str, ids: Any, info: dict[str, float], env_reward: float
) -> RewardInput:
    """One finished episode as a reward sees it (``ids``: the generated tokens only)."""
    return RewardInput(
        prompt=prompt.text,
        response=text,
        response_ids=[int(i) for i in ids],
        answer=prompt.answer if prompt.answer != "" else None,
        info=dict(info),
        env_reward=float(env_reward),
        task=str(prompt.meta.get("task", type(task).__name__)),
    )


def turn_seed(seed: int, group: int, sample: int, turn: int) -> int:
    """The sampling seed of one turn of a multi-turn episode: sample ``sample`` of the
    actor's ``group``-th group, its ``turn``-th request, in a run with ``seed``. A hash,
    so no two (group, sample, turn) of a run, nor of runs with other seeds, share one
    (a single-turn group's seed, ``group_sampling``, is a counter: one request per group)."""
    key = f"asyncrl-turn/{seed}/{group}/{sample}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def turn_sampling(
    engine: Engine, sampling: Sampling, group: int, sample: int, turn: int
) -> Sampling:
    """``sampling`` (n=1) seeded for one turn (:func:`turn_seed`, from the engine's seed,
    the run's): what an episode samples then depends on its place in the actor's start
    order, never on what shares the engine's batches. An engine with no seed:
    ``sampling``."""
    if engine.seed is None:
        return sampling
    return sampling.with_seed(turn_seed(int(engine.seed), group, sample, turn))
