"""EvalActor: a Ray actor with its own engine that scores one policy version on
the held-out sets, while training goes on.

    evaluate([ref], V):  load the published weights of V (the object-store path the
                         rollout actors' update_weights takes: actor/weights.py)
                         ─▶ per set: every prompt greedy (pass@1) and k samples at
                            eval.temperature (pass@k), all requests at once
                         ─▶ {set: {"pass@1", "pass@k", "reward_mean"}}, "version": V

Never in the broker's sync set: the driver hands it weights only when it is idle
(eval/driver.py), so a slow evaluation costs skipped versions, never a training wait.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from asyncrl.engine.protocol import Engine, Sampling, text_sampling
from asyncrl.engine.settings import EngineSettings
from asyncrl.eval.settings import EvalSettings
from asyncrl.tasks.base import Prompt, Task, ascore


class EvalActor:
    def __init__(
        self,
        model_path: str,
        engine: EngineSettings,
        settings: EvalSettings,
        sets: dict[str, tuple[Task, list[Prompt]]],
        max_tokens: int,
        seed: int = 0,
    ):
        from asyncrl.engine.backend import warm_engine_start

        warm_engine_start(engine)  # first: the engine core's fork server, forked from here
        self.model_path, self.engine_settings, self.seed = model_path, engine, seed
        self.settings = settings
        self.sets = sets
        self.max_tokens = max_tokens
        self.engine: Engine | None = None
        self.version = 0
        self.evaluations = 0

    async def start(self) -> None:
        from asyncrl.actor import weights
        from asyncrl.engine.backend import make_engine

        self.engine = make_engine(self.model_path, self.engine_settings, self.seed)
        self._weights = weights.WeightUpdates("eval", False, self._labelled)
        await self.engine.label(0)

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
            out["sets"][name] = await self._score_set(task, prompts)
        self.evaluations += 1
        out["seconds"] = time.time() - t0
        return out

    async def _score_set(self, task: Task, prompts: list[Prompt]) -> dict[str, float]:
        s = self.settings
        greedy = self._params(1, 0.0)
        sampled = self._params(s.k, s.temperature)
        jobs = [self._generate(p, greedy) for p in prompts]
        jobs += [self._generate(p, sampled) for p in prompts]
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

    def _params(self, n: int, temperature: float) -> Sampling:
        return text_sampling(
            temperature, self.max_tokens, n, self.seed if temperature > 0 else None
        )

    async def _generate(self, prompt: Prompt, sampling: Sampling) -> list[str]:
        out = await self.engine.generate(prompt.text, sampling, "eval-" + uuid.uuid4().hex[:12])
        return [c.text for c in out.completions]

    def stop(self) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return {"evaluations": self.evaluations, "version": self.version}
