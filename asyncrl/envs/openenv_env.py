"""``env=openenv env.server=<module>``: an OpenEnv environment (Meta / Hugging Face
``openenv-core``) as an asyncrl env, run in local server processes (openenv_server.py)
and spoken to with openenv's own client (``GenericEnvClient``: reset / step over the
server's ``/ws`` websocket, one server session per episode).

    prompt   task.header + reset's observation        (openenv reset(seed); never trained)
    turn k   the policy's text ──▶ step({action_key: text})   (generated, trained)
    observe  the step's observation as text           (never trained) ... until done
    reward   the sum of the steps' rewards; ``done`` ends the episode

* The observation's text is its ``observation_key`` field, or (``observation_key: ""``)
  the whole observation as JSON with sorted keys. OpenEnv's ``reward`` (None: 0) and
  ``done`` are taken as they are; a reward that is not a finite number, an observation
  that is not an object, or an error answer is garbage: the episode raises.
* The seed of ``reset`` is the prompt's (``OpenEnvTask`` draws one per prompt), so the n
  episodes of a group start from the same observation when the env honours seeds.
* Any failure (server would not start, crashed, hung past ``step_timeout_s``, garbage)
  raises :class:`asyncrl.envs.openenv_server.OpenEnvServerError`: the runner scores the
  episode ``finish_reason="env_error"`` (reward 0), and a dead or hung server is killed
  and started again for the next episode.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import string
from typing import Any, NoReturn

from asyncrl.config import ConfigError, settings_from
from asyncrl.envs.base import StepResult
from asyncrl.envs.openenv_server import Lease, OpenEnvServerError, ServerPool, shared_pool
from asyncrl.envs.settings import OpenEnvSettings
from asyncrl.tasks.base import Prompt, Task

SEED_RANGE = 2**31  # reset seeds: OpenEnv's ResetRequest takes any integer >= 0


class OpenEnvTask:
    """Prompts for ``env=openenv``: a seed for the env's reset (``meta["seed"]``) and a
    fixed ``header`` before the env's first observation. Graded by the env only.
    ``alphabet``: the characters the env's text uses (the tiny model's tokenizer)."""

    env_prompt = True  # the prompt's text is completed by the env's reset (may be empty)

    def __init__(self, header: str = "", alphabet: str = ""):
        self.header = str(header)
        self._alphabet = str(alphabet) or string.printable

    @property
    def alphabet(self) -> str:
        return self._alphabet + self.header

    def sample(self, rng: random.Random) -> Prompt:
        return Prompt(text=self.header, meta={"seed": rng.randrange(SEED_RANGE)})

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        raise RuntimeError(
            "task=openenv is graded by the OpenEnv environment's reward, not from text: "
            "run it with env=openenv"
        )


class OpenEnvEnv:
    """One episode in one session of this process's OpenEnv server pool (see the module
    doc). Built once in the driver to check the settings: starts nothing there."""

    def __init__(self, pool: ServerPool | None = None, **kwargs: Any):
        self.settings: OpenEnvSettings = settings_from(OpenEnvSettings, kwargs, "env")
        for name in ("openenv", "uvicorn"):
            if importlib.util.find_spec(name) is None:
                raise ConfigError(
                    "env._target_=asyncrl.envs.openenv_env.OpenEnvEnv needs openenv-core: "
                    "pip install 'asyncrl[openenv]' and "
                    "pip install --no-deps openenv-core==0.3.0 (scripts/setup.sh does)"
                )
        if not self.settings.server:
            raise ConfigError(
                "env.server='': expected the module of an OpenEnv app, `pkg.module` or "
                "`pkg.module:app` (e.g. built by openenv's create_app)"
            )
        module = self.settings.server.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package that does not exist
            found = False
        if not found:
            raise ConfigError(f"env.server={self.settings.server}: no module {module!r}")
        self.pool = pool  # None: this process's shared pool, on the first reset
        self.lease: Lease | None = None
        self.client: Any = None

    async def reset(self, sample: Prompt, task: Task) -> str:
        """Open a session and reset it; returns the first observation's text (the runner
        appends it to the prompt)."""
        from openenv.core.generic_client import GenericEnvClient

        await self.close()
        pool = self.pool = self.pool or shared_pool(self.settings)
        self.lease = await pool.lease()
        self.client = GenericEnvClient(
            base_url=self.lease.url,
            connect_timeout_s=self.settings.step_timeout_s,
            message_timeout_s=self.settings.step_timeout_s,
        )
        seed = sample.meta.get("seed")
        kwargs = {} if seed is None else {"seed": int(seed)}
        result = await self._call("reset", self.client.reset(**kwargs))
        return self._text(result.observation)

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        if self.client is None:
            raise OpenEnvServerError("step before reset")
        result = await self._call("step", self.client.step({self.settings.action_key: text}))
        reward = 0.0 if result.reward is None else result.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            await self._failed("step", f"garbage: reward {reward!r} is not a number")
        if not math.isfinite(reward) or not isinstance(result.done, bool):
            await self._failed("step", f"garbage: reward {reward!r}, done {result.done!r}")
        if result.done:
            await self.close()
            return StepResult(reward=float(reward), done=True)
        return StepResult(observation=self._text(result.observation), reward=float(reward))

    async def _call(self, what: str, coro: Any) -> Any:
        """Await one client call within ``step_timeout_s``; any failure is the server's."""
        try:
            return await asyncio.wait_for(coro, self.settings.step_timeout_s)
        except Exception as e:  # noqa: BLE001 - timeout, closed socket, error answer, bad JSON
            await self._failed(what, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    async def _failed(self, what: str, why: str) -> NoReturn:
        lease, pool = self.lease, self.pool
        found = await pool.check(lease) if lease is not None and pool is not None else ""
        await self.close()
        state = f" (server {found})" if found else ""
        raise OpenEnvServerError(f"openenv {what}{state}: {why}"[:500])

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            raise OpenEnvServerError(f"garbage: observation {observation!r:.80} is not an object")
        key = self.settings.observation_key
        if not key:
            return json.dumps(observation, sort_keys=True)
        if key not in observation:
            raise OpenEnvServerError(
                f"env.observation_key={key}: not in the observation (keys: {sorted(observation)})"
            )
        value = observation[key]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    async def close(self) -> None:
        """End the session (closes its websocket: the server drops the env) and give the
        server back to the pool."""
        client, self.client = self.client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.settings.step_timeout_s)
            except Exception:  # noqa: BLE001 - a dead server's socket: nothing to close
                pass
        if self.lease is not None and self.pool is not None:
            self.pool.release(self.lease)
            self.lease = None
