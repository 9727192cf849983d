"""LLM-as-judge (``reward=judge``): a frozen model on its own engine in its own Ray
actor grades each episode by a rubric.

::

    Judge.score(batch)                    (on a reward worker)
      cache hit (prompt, response)? ──▶ the cached score, no call
      else render(prompt, response)       escaped, fenced, fresh tag (fence.py)
        ──▶ JudgeServer.generate(prompts) one engine request each; the engine batches them
        ◀── raw texts ── parse_score: exactly one "SCORE: <0-10>" line
      malformed: re-rendered and re-asked up to `retries` times (sampled anew);
      still malformed: the episode's error (the combiner scores it reward.on_error and
      logs reward/judge_errors); a parsed score is cached (LRU, `cache_size` entries)

The judge's weights are never synced: it is a separate engine the broker does not
know. ``model: tiny`` is :func:`asyncrl.rewards.tiny_rm.ensure_tiny_judge` (a format-only
judge: its scores mean nothing, its malformed answers exercise the failure path).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, check_model_dir
from asyncrl.rewards import fence
from asyncrl.rewards.base import Reward, RewardInput, RewardOutput
from asyncrl.rewards.serving import actor_name, kill_actor, shared_actor

# The judge's engine: its prompt is the rubric plus two fenced blocks (~500 characters
# with the tiny judge's one-character tokens), far longer than the policy's 64.
ENGINE_DEFAULTS = {"max_model_len": 1024, "max_num_seqs": 64, "kv_cache_memory_mb": 128}


@dataclass
class Refused:
    """A judge prompt the engine would not take (longer than its ``max_model_len``, or a
    failure of that one request): its episode's error, not retried (the same prompt
    would be refused again); the other prompts of the call are unharmed."""

    why: str
    kind: str = "judge_refused"


class JudgeServer:
    """The Ray actor holding the judge's engine (async: calls overlap in it)."""

    def __init__(self, model_dir: str, engine: dict[str, Any], seed: int):
        from asyncrl.engine.backend import warm_engine_start
        from asyncrl.engine.settings import EngineSettings

        self.model_dir, self.seed = model_dir, seed
        self.settings = EngineSettings.defaults(**engine)  # actor.engine's values, then these
        warm_engine_start(self.settings)  # the engine core's fork server, forked from here
        self.engine: Any = None
        self.requests = 0

    async def generate(
        self, prompts: list[str], temperature: float, max_tokens: int
    ) -> list[str | Refused]:
        """One answer per prompt, in order: the judge's text, or why the engine refused
        that prompt (each prompt is rendered and generated on its own)."""
        from asyncrl.engine.backend import make_engine
        from asyncrl.engine.protocol import text_sampling

        if self.engine is None:
            self.engine = make_engine(self.model_dir, self.settings, self.seed)
        self.requests += len(prompts)

        async def one(text: str) -> str | Refused:
            # no per-request seed: vLLM rewinds a seeded CPU generator when a long
            # prompt's prefill is chunked, which the CPU generator cannot do (the engine
            # dies); unseeded, each retry still samples anew from the engine's generator
            sampling = text_sampling(temperature, max_tokens)
            try:  # each prompt on its own: one the engine refuses fails only its episode
                # tokenised and length-checked by the engine before it is queued
                out = await self.engine.generate(text, sampling, uuid.uuid4().hex)
                return out.completions[0].text
            except Exception as e:  # noqa: BLE001 - too long for max_model_len, or engine-side
                limit = self.settings.max_model_len
                return Refused(f"judge prompt refused (engine.max_model_len={limit}): "
                               f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")  # fmt: skip

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class Judge(Reward):
    """``reward.components`` entry: ``{_target_: asyncrl.rewards.judge.Judge, model: tiny}``.

    The value is the judge's ``SCORE`` / 10, in [0, 1]. Sub-scores (logged
    ``reward/judge/<key>``): ``attempts`` (judge calls this episode took, 0 on a cache
    hit) and ``cached`` (1 on a hit).
    """

    name = "judge"  # the default metric name (reward/judge); the start-up check reads it

    def __init__(
        self,
        model: str = "tiny",
        name: str = "judge",
        rubric: str = fence.RUBRIC,
        template: str = fence.TEMPLATE,
        retries: int = 2,
        temperature: float = 1.0,
        max_tokens: int = 16,
        cache_size: int = 4096,
        max_batch: int = 32,
        timeout_s: float = 120.0,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
        seed: int = 0,
        engine: dict[str, Any] | None = None,
    ):
        try:
            fence.check_template(template, "template")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        for key, v, low in (("retries", retries, 0), ("max_tokens", max_tokens, 1),
                            ("cache_size", cache_size, 0), ("max_batch", max_batch, 1)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{key}={v!r}: expected an integer >= {low}")
        if temperature < 0 or timeout_s <= 0:
            raise ConfigError(
                f"temperature={temperature}, timeout_s={timeout_s}: expected >= 0, > 0"
            )
        if model == "tiny":
            from asyncrl.rewards.tiny_rm import ensure_tiny_judge

            self.model_dir = str(ensure_tiny_judge())
        else:
            try:
                self.model_dir = str(check_model_dir(model))
            except ConfigError as e:  # its message says model.path: this key is model
                raise ConfigError(str(e).replace("model.path=", "model=", 1)) from e
        self.name, self.rubric, self.template, self.retries = name, rubric, template, retries
        self.temperature, self.max_tokens, self.cache_size = temperature, max_tokens, cache_size
        self.max_batch, self.timeout_s, self.seed = max_batch, timeout_s, seed
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.engine = {**ENGINE_DEFAULTS, **(engine or {})}
        self.cache: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.stats = {"calls": 0, "hits": 0, "errors": 0}
        self._server: Any = None
        # the judge call, a process boundary: tests put a recorder here
        self.generate: Callable[[list[str]], Awaitable[list[str | Refused]]] = self._remote_generate

    @staticmethod
    def check_config(kwargs: dict[str, Any]) -> None:
        """In the driver, before Ray starts (RewardSettings.check): template and model."""
        try:
            fence.check_template(kwargs.get("template", fence.TEMPLATE), "template")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if kwargs.get("model", "tiny") != "tiny":
            try:
                check_model_dir(str(kwargs["model"]))
            except ConfigError as e:
                raise ConfigError(str(e).replace("model.path=", "model=", 1)) from e

    def server(self) -> Any:
        if self._server is None:
            key = {"model": self.model_dir, "engine": self.engine, "seed": self.seed}
            options = {
                "num_cpus": self.num_cpus,
                "num_gpus": self.num_gpus,
                "max_concurrency": 1000,
            }
            self._server = shared_actor(
                JudgeServer,
                actor_name("judge", key),
                options,
                self.model_dir,
                self.engine,
                self.seed,
            )
        return self._server

    async def _remote_generate(self, prompts: list[str]) -> list[str | Refused]:
        return await self.server().generate.remote(prompts, self.temperature, self.max_tokens)

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        out: list[RewardOutput | None] = [None] * len(batch)
        todo, errors = [], [""] * len(batch)
        for i, x in enumerate(batch):
            hit = self.cache.get((x.prompt, x.response))
            if hit is not None:
                self.cache.move_to_end((x.prompt, x.response))
                self.stats["hits"] += 1
                out[i] = RewardOutput(hit, {"attempts": 0.0, "cached": 1.0})
            else:
                todo.append(i)
        for attempt in range(1, self.retries + 2):
            if not todo:
                break
            prompts = [fence.render(batch[i].prompt, batch[i].response, self.rubric, self.template)
                       for i in todo]  # fmt: skip
            self.stats["calls"] += 1
            answers = await self.generate(prompts)
            still = []
            for i, text in zip(todo, answers, strict=True):
                if isinstance(text, Refused):  # its own episode's error, not retried
                    self.stats["errors"] += 1
                    out[i] = RewardOutput(0.0, {"attempts": float(attempt), "cached": 0.0},
                                          text.why)  # fmt: skip
                    continue
                value, why = fence.parse_score(text)
                if value is None:
                    errors[i] = f"{why} (attempt {attempt})"
                    still.append(i)
                    continue
                self._remember((batch[i].prompt, batch[i].response), value)
                out[i] = RewardOutput(value, {"attempts": float(attempt), "cached": 0.0})
            todo = still
        for i in todo:  # malformed after every retry: recorded, never raised
            self.stats["errors"] += 1
            out[i] = RewardOutput(
                0.0, {"attempts": float(self.retries + 1), "cached": 0.0}, errors[i]
            )
        return out  # type: ignore[return-value]

    def _remember(self, key: tuple[str, str], value: float) -> None:
        if self.cache_size == 0:
            return
        self.cache[key] = value
        self.cache.move_to_end(key)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    async def close(self) -> None:
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.shutdown.remote(), 30)
            except Exception:  # noqa: BLE001, S110 - another worker closed it first
                pass
            kill_actor(self._server)
            self._server = None
