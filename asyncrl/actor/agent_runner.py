"""Episodes of a black-box agent program (``env=agent``, asyncrl/envs/agent.py): the
agent runs its own loop against the actor's endpoint (asyncrl/actor/endpoint.py), which
records its calls; each of an episode's branches is one trajectory.

    run_group(prompt): n episodes at once (asyncio.gather), each one:
      endpoint.open(episode id) ─▶ the agent program (a subprocess) with the episode's
        base URL and the endpoint's token ─▶ its calls, recorded ─▶ its report
      endpoint.close(episode id) ─▶ EpisodeLog ─▶ one Trajectory per branch, every one
        with the reward the program reported (0 and ``env_error`` if it failed)
    then the group is scored by the reward components, as the multi-turn runner's
    what waits: the agent programs and the engine's requests they make; nothing else.

A group holds n episodes' trajectories: n when no agent forked its history, more when
one did (each fork is one more trajectory with the episode's reward); an episode that
made no call is one empty trajectory (its finish reason says why). A weight update that
aborts an agent's request (``actor.update_mode=abort``) aborts the group
(:class:`asyncrl.actor.episode.EpisodeAborted`): the actor runs the prompt again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from asyncrl.actor.agent_log import Branch, EpisodeLog, branch_trajectory
from asyncrl.actor.endpoint import AgentEndpoint
from asyncrl.actor.episode import EpisodeAborted, reward_input
from asyncrl.actor.settings import ActorSettings
from asyncrl.engine.protocol import Engine, policy_sampling
from asyncrl.envs.agent import AgentOutcome
from asyncrl.envs.settings import EnvSettings
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.pool import RewardClient
from asyncrl.tasks.base import Prompt, Task
from asyncrl.trajectory import Trajectory, TrajectoryGroup


class AgentEpisodes:
    """An :class:`asyncrl.actor.episode.EpisodeRunner` over an agent program; its
    endpoint starts with the first group, on the actor's event loop."""

    def __init__(
        self,
        engine: Engine,
        task: Task,
        settings: ActorSettings,
        env: EnvSettings,
        version: Callable[[], int],
        rewards: RewardClient | None = None,
    ):
        self.task, self.env, self.version = task, env, version
        self.rewards = rewards or RewardClient()
        self.n = settings.sampling.n
        self.endpoint = AgentEndpoint(
            engine, replace(policy_sampling(settings.sampling), n=1), version, settings.engine.max_model_len, env.max_tokens,
            env.max_turns, chat_template=getattr(env.make(), "chat_template", None),
        )  # fmt: skip
        self._groups = 0

    async def run_group(self, prompt: Prompt) -> TrajectoryGroup:
        await self.endpoint.start()
        index = self._groups  # before any await that others share: the seeds' order
        self._groups += 1
        gid = f"{index:08x}{uuid.uuid4().hex[:16]}"
        runs = await asyncio.gather(*(self._episode(prompt, gid, index, i) for i in range(self.n)))
        if any(log.aborted for log, _, _ in runs):
            raise EpisodeAborted(f"group {gid}: a weight update aborted an agent's request")
        trajs: list[Trajectory] = []
        inputs: list[RewardInput] = []
        for log, outcome, t_start in runs:
            for t, b in self._trajectories(log, outcome, prompt, gid, t_start):
                trajs.append(t)
                inputs.append(
                    reward_input(self.task, prompt, "".join(b.generated),
                                 t.response_ids[t.loss_mask], outcome.info, outcome.reward)
                )  # fmt: skip
        await self.rewards.apply(trajs, inputs)
        return TrajectoryGroup(gid, trajs)

    async def _episode(
        self, prompt: Prompt, gid: str, index: int, i: int
    ) -> tuple[EpisodeLog, AgentOutcome, float]:
        t_start = time.time()
        eid = f"{gid}-{i}"
        self.endpoint.open(eid, index, i)
        try:
            program = self.env.make()
            outcome = await program.run_agent(
                self.endpoint.base_url(eid), self.endpoint.token, prompt, self.env.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - an agent's failure is a recorded outcome
            outcome = AgentOutcome(error=f"{type(e).__name__}: {e}")
        finally:
            log = self.endpoint.close(eid)
        return log, outcome, t_start

    def _trajectories(
        self, log: EpisodeLog, outcome: AgentOutcome, prompt: Prompt, gid: str, t_start: float
    ) -> list[tuple[Trajectory, Branch]]:
        finish = "env_error" if outcome.error else "done"
        branches = log.branches
        if not branches:  # no call: one empty trajectory keeps the episode counted
            ids = self.endpoint.tokenizer.encode(prompt.text, add_special_tokens=False)
            branches = [Branch(list(ids), prompt.text, prompt.text)]
            outcome = outcome if outcome.error else AgentOutcome(error="the agent made no call")
            finish = "env_error"
        reward = 0.0 if outcome.error else outcome.reward
        out = []
        for k, b in enumerate(branches):
            tid = log.episode_id if k == 0 else f"{log.episode_id}.{k}"
            t = branch_trajectory(b, tid, gid, reward, finish, outcome.error, t_start, time.time())
            t.reward_breakdown = dict(outcome.info)
            out.append((t, b))
        return out

    async def close(self) -> None:
        """Stop the endpoint (the actor's process ending stops it too)."""
        await self.endpoint.stop()
