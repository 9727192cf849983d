"""A small OpenEnv environment for tests/test_openenv_env.py and the ``env=openenv`` run:
addition in the shipped tiny model's alphabet (``7+12=`` -> ``19``), written against
openenv-core's own server API (``Environment``, ``Action``, ``Observation``,
``create_app``), so asyncrl talks to it exactly as to any OpenEnv server.

    reset(seed)  ->  prompt "a+b=" (a, b from the seed)
    step(answer) ->  right: reward 1 (first try) or 0.5 (second), done
                     wrong: reward 0, the same prompt again; done after two tries
    step("crash")   the server process exits (a crash mid-episode)
    step("hang")    the server's event loop blocks (a hung server: /health stops answering)

``garbage_app``: a websocket server that answers reset properly and step with bytes
that are not JSON.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

from openenv.core import Action, Environment, Observation, State, create_app
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute

MAX_OPERAND = 19  # the shipped tiny model's addition (conf/task/addition.yaml)
TRIES = 2


class AnswerAction(Action):
    message: str


class SumObservation(Observation):
    prompt: str = ""
    tries: int = 0


class AdditionEnvironment(Environment[AnswerAction, SumObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()))
        self.prompt, self.answer, self.tries = "", "", 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any):
        rng = random.Random(seed)
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        self.prompt, self.answer, self.tries = f"{a}+{b}=", str(a + b), 0
        self._state = State(episode_id=episode_id or str(uuid.uuid4()))
        return SumObservation(prompt=self.prompt)

    def step(self, action: AnswerAction, timeout_s: float | None = None, **kw: Any):
        text = action.message.strip()
        if text == "crash":
            os._exit(3)
        self.tries += 1
        self._state.step_count += 1
        if text == self.answer:
            return SumObservation(done=True, reward=1.0 if self.tries == 1 else 0.5)
        done = self.tries >= TRIES
        return SumObservation(prompt=self.prompt, tries=self.tries, done=done, reward=0.0)

    async def step_async(self, action: AnswerAction, timeout_s: float | None = None, **kw: Any):
        if action.message.strip() == "hang":
            time.sleep(3600)  # blocks the server's event loop: nothing answers any more
        return self.step(action)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    AdditionEnvironment, AnswerAction, SumObservation, env_name="addition",
    max_concurrent_envs=64,
)  # fmt: skip


async def _health(request: Any) -> JSONResponse:
    return JSONResponse({"status": "healthy"})


async def _garbage_ws(ws: Any) -> None:
    await ws.accept()
    while True:
        msg = await ws.receive_json()
        if msg.get("type") == "reset":
            await ws.send_json({"type": "observation", "data": {"observation": {"prompt": "1+1="}}})
        elif msg.get("type") == "step":
            await ws.send_text("%% not json")
        else:
            return


garbage_app = Starlette(routes=[Route("/health", _health), WebSocketRoute("/ws", _garbage_ws)])
