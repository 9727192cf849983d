"""EvalActor: a Ray actor with its own engine that scores one policy version on
the held-out sets, while training goes on.

    evaluate([ref], V):  load the published weights of V (the object-store path the
                         rollout actors' update_weights takes: actor/weights.py)
                         ─▶ per set (SetScorer): every prompt greedy (pass@1) and k
                            samples at eval.temperature (pass@k), all requests at once
                            (episodes: at most eval.max_inflight_groups groups at once)
                         ─▶ {set: {"pass@1", "pass@k", "reward_mean", ...}}, "version": V

A single-turn run scores each completion with the task's reward. A run whose env takes
turns (a tool or chat env: ``runs_turns`` in asyncrl/actor/env_runner.py) runs each
prompt as whole episodes through the actor's own runner (:class:`MultiTurnEpisodes`, the
same env code, one greedy episode and a group of k sampled ones) and scores the env's
reward; ``tool_call_share`` is the share of greedy episodes with at least one
well-formed tool call (``StepResult.tool_calls``).

Never in the broker's sync set: the driver hands it weights only when it is idle
(eval/driver.py), so a slow evaluation costs skipped versions, never a training wait.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from asyncrl.actor.env_runner import MultiTurnEpisodes, runs_turns
from asyncrl.actor.settings import ActorSettings
from asyncrl.engine.protocol import Engine, Sampling, text_sampling
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.settings import EvalSettings
from asyncrl.tasks.base import Prompt, Task, ascore
from asyncrl.trajectory import TrajectoryGroup


class SetScorer:
    """Scores prompt sets on an engine's current weights: single-turn completions, or
    (``env`` taking turns) whole episodes of the actor's runner."""

    def __init__(
        self,
        engine: Engine,
        settings: EvalSettings,
        max_tokens: int,
        seed: int,
        actor: ActorSettings | None = None,  # the episodes' limits (max_model_len)
        env: EnvSettings | None = None,  # None or single-turn: completions scored
    ):
        self.engine, self.settings = engine, settings
        self.max_tokens, self.seed = max_tokens, seed
        self.actor = actor
        self.env = env if runs_turns(env) else None
        if self.env is not None and actor is None:
            raise ValueError("an env that takes turns needs the actor's settings (its limits)")

    @property
    def episodes(self) -> bool:
        return self.env is not None

    async def score(self, task: Task, prompts: list[Prompt]) -> dict[str, float]:
        if self.episodes:
            return await self.score_episodes(task, prompts)
        return await self.score_texts(task, prompts)

    async def score_texts(self, task: Task, prompts: list[Prompt]) -> dict[str, float]:
        s = self.settings
        greedy = self._params(1, 0.0)
        sampled = self._params(s.k, s.temperature)
        jobs = [self._generate(p, greedy) for p in prompts]
        jobs += [self._generate(p, sampled) for p in prompts]
        # every request at once: the engine queues and batches them, and no clock runs per
        # request (unlike an episode's env.timeout_s)
        texts = await asyncio.gather(*jobs)
        n = len(prompts)
        passed1, passedk, rewards = 0, 0, []
        for i, p in enumerate(prompts):
            r1 = [(await ascore(task, p, t))[0] for t in texts[i]]
            rk = [(await ascore(task, p, t))[0] for t in texts[n + i]]
            passed1 += r1[0] >= s.pass_reward
            passedk += any(r >= s.pass_reward for r in rk)
            rewards += r1
        return {
            "pass@1": passed1 / max(n, 1),
            "pass@k": passedk / max(n, 1),
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "prompts": float(n),
        }

    async def score_episodes(self, task: Task, prompts: list[Prompt]) -> dict[str, float]:
        """One greedy episode and a group of k sampled ones per prompt, through the
        actor's runner; the trajectories' reward is the env's (no reward workers). At
        most ``eval.max_inflight_groups`` groups run at once (the rest wait to start), so
        an episode's ``env.timeout_s`` counts from its own start."""
        s = self.settings
        greedy = self._runner(task, self._episode_params(1, 0.0))
        sampled = self._runner(task, self._episode_params(s.k, s.temperature))
        slots = asyncio.Semaphore(s.max_inflight_groups)

        async def run(runner: MultiTurnEpisodes, prompt: Prompt) -> TrajectoryGroup:
            async with slots:
                return await runner.run_group(prompt)

        groups: list[TrajectoryGroup] = await asyncio.gather(
            *[run(greedy, p) for p in prompts], *[run(sampled, p) for p in prompts]
        )
        n = len(prompts)
        ones = [g.trajectories[0] for g in groups[:n]]
        passedk = sum(any(t.reward >= s.pass_reward for t in g.trajectories) for g in groups[n:])
        called = sum(t.episode.get("tool_calls", 0.0) > 0 for t in ones)
        return {
            "pass@1": sum(t.reward >= s.pass_reward for t in ones) / max(n, 1),
            "pass@k": passedk / max(n, 1),
            "reward_mean": sum(t.reward for t in ones) / max(n, 1),
            "tool_call_share": called / max(n, 1),
            "prompts": float(n),
        }

    def _runner(self, task: Task, sampling: Sampling) -> MultiTurnEpisodes:
        engine = self.engine
        return MultiTurnEpisodes(engine, task, self.actor, self.env, lambda: engine.version,
                                 sampling=sampling)  # fmt: skip

    def _episode_params(self, n: int, temperature: float) -> Sampling:
        """A group's sampling: log-probs on (the runner's trajectories carry them)."""
        return Sampling(n, temperature, self.max_tokens, seed=None)

    def _params(self, n: int, temperature: float) -> Sampling:
        return text_sampling(
            temperature, self.max_tokens, n, self.seed if temperature > 0 else None
        )

    async def _generate(self, prompt: Prompt, sampling: Sampling) -> list[str]:
        rid = "eval-" + uuid.uuid4().hex[:12]
        images = list(prompt.meta.get("images", ()))  # an image prompt's PNGs, as the actor's
        out = await self.engine.generate(prompt.text, sampling, rid, images=images)
        return [c.text for c in out.completions]


class EvalActor:
    def __init__(
        self,
        model_path: str,
        actor: ActorSettings,
        settings: EvalSettings,
        sets: dict[str, tuple[Task, list[Prompt]]],
        max_tokens: int,
        seed: int = 0,
        env: EnvSettings | None = None,
    ):
        from asyncrl.engine.backend import warm_engine_start

        warm_engine_start(actor.engine)  # first: the engine core's fork server, forked from here
        self.model_path, self.actor_settings, self.seed = model_path, actor, seed
        self.settings = settings
        self.sets = sets
        self.max_tokens = max_tokens
        self.env = env
        self.engine: Engine | None = None
        self.scorer: SetScorer | None = None
        self.version = 0
        self.evaluations = 0

    async def start(self) -> None:
        from asyncrl.actor import weights
        from asyncrl.engine.backend import make_engine

        self.engine = make_engine(self.model_path, self.actor_settings.engine, self.seed)
        self._weights = weights.WeightUpdates("eval", False, self._labelled)
        await self.engine.label(0)
        self.scorer = SetScorer(self.engine, self.settings, self.max_tokens, self.seed,
                                self.actor_settings, self.env)  # fmt: skip

    def _labelled(self, version: int) -> None:
        self.version = version

    def ping(self) -> str:
        return "eval"

    async def evaluate(self, ref_list: list, version: int) -> dict[str, Any]:
        """Load ``version``'s weights (``ref_list[0]``: the learner's PackedWeights in
        the object store) and score every set on them."""
        t0 = time.time()
        state = await ref_list[0]
        # "wait": nothing generates between evaluations, so nothing is cut short
        await self._weights.load_state_dict(self.engine, "wait", state, version)
        out: dict[str, Any] = {"version": version, "sets": {}}
        for name, (task, prompts) in self.sets.items():
            out["sets"][name] = await self.scorer.score(task, prompts)
        self.evaluations += 1
        out["seconds"] = time.time() - t0
        return out

    def stop(self) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return {"evaluations": self.evaluations, "version": self.version}
