"""``env=verifiers env.id=<module or object>``: a prime-rl verifiers environment (its
classic ``SingleTurnEnv`` / ``MultiTurnEnv`` / ``ToolEnv`` stack, verifiers 0.3.1, the
``verifiers`` extra) run inside the actor, scored by the env's own rubric.

    run_group(prompt): n episodes at once (asyncio.gather), each one:
      vf_env.rollout(row, EngineClient, ...)      verifiers drives its own turn loop
        each turn: client.get_response(messages) ─▶ EngineClient:
          messages ─▶ token ids (first turn: the chat template's render; later turns:
                      the previous ids + the engine's generated ids + the rendered new
                      messages, mask 0; the history is never re-tokenised)
          engine.generate(ids) ─▶ generated ids, log-probs, versions (mask 1)
      vf_env.rubric.score_group([state]) ─▶ reward, reward/<metric>
    what waits: the engine's requests and the env's own awaits (one event loop).

``EngineClient`` is a ``verifiers.Client`` backed by the actor's engine object: no
network service is involved. A later turn's messages must extend the previous turn's
(else ``env_error``: "history rewritten"), and the chat template must render the history
append-only for this model and render the model's turn as its own tokens' text (else
``env_error`` naming the mismatch). Tool calls are read from the generated text in the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format.

Every failure of the env (raises, hangs past ``env.timeout_s``, a rubric that raises or
returns a non-number) ends the episode with ``finish_reason="env_error"`` (``timeout`` for
a hang), reward 0, never a crashed actor.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import verifiers as vf
from verifiers.legacy.clients import Client
from verifiers.legacy.types import Response, ResponseMessage, ToolCall, Usage

from asyncrl.engine.protocol import Engine, Sampling, version_salt
from asyncrl.models.tool_calls import HERMES
from asyncrl.tasks.base import Prompt
from asyncrl.trajectory import Trajectory, TrajectoryGroup, token_fields

MODEL_NAME = "asyncrl-actor"  # the model name verifiers passes to its client (unused)
_LOADED: dict[str, Any] = {}  # env.id -> its verifiers Environment (one per process)
_SIGNAL_LOCK = threading.Lock()


class VerifiersError(RuntimeError):
    """The episode's messages or template break token exactness (recorded as env_error)."""


def load_environment(env_id: str) -> Any:
    """The verifiers Environment ``env_id`` names: a module with ``load_environment()``,
    or a dotted ``module.attr`` that is an Environment, a class or a factory. Cached per
    process (the task and the runner share it)."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env.id={env_id!r}: name the verifiers env (env.id=my_module)")
    if env_id not in _LOADED:
        try:
            obj: Any = importlib.import_module(env_id)
            obj = obj.load_environment
        except ModuleNotFoundError:
            mod, _, attr = env_id.rpartition(".")
            if not mod:
                raise ValueError(f"env.id={env_id!r}: no such module") from None
            obj = getattr(importlib.import_module(mod), attr)
        with _keep_signal_handlers():
            env = obj if isinstance(obj, vf.Environment) else obj()
        if not isinstance(env, vf.Environment):
            raise ValueError(
                f"env.id={env_id!r} gave {type(env).__name__}, not a verifiers Environment"
            )
        _LOADED[env_id] = env
    return _LOADED[env_id]


@contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """A verifiers Environment installs SIGINT/SIGTERM handlers when built, which fails
    off the main thread (the actor builds its runner in a worker thread) and would replace
    the driver's and Ray's own handlers: while one is built, ``signal.signal`` does nothing."""
    with _SIGNAL_LOCK:
        real = signal.signal
        signal.signal = lambda signum, handler: signal.getsignal(signum)
        try:
            yield
        finally:
            signal.signal = real


class VerifiersTask:
    """``task`` of ``env=verifiers``: draws rows of the env's dataset. ``Prompt.meta``
    carries the row (``example_id``); the rubric scores, never :meth:`reward`."""

    def __init__(self, id: str, chat: bool = True, system: str | None = None):
        # chat/system: model presets (model=smollm2) set them for every task; a verifiers
        # env's rows carry its own messages (its system_prompt), which are what is rendered
        self.id = id
        self.rows = list(load_environment(id).get_dataset())

    def sample(self, rng: random.Random) -> Prompt:
        row = self.rows[rng.randrange(len(self.rows))]
        last = row["prompt"][-1]
        return Prompt(text=str(last.get("content", "")), answer=str(row.get("answer", "")),
                      meta={"example_id": int(row["example_id"])})  # fmt: skip

    def row(self, example_id: int) -> dict[str, Any]:
        return next(r for r in self.rows if int(r["example_id"]) == example_id)

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise VerifiersError("env=verifiers: the verifiers env's rubric scores episodes")


@dataclass
class Record:
    """One episode's token sequence as the engine saw it (per-token, response order)."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    seen: list[dict] = field(default_factory=list)  # the last request's messages
    rendered: str = ""  # the last request's rendered text
    generated: str = ""  # the last turn's text (special tokens kept)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    turn_prompt_tokens: int = 0  # prompt tokens over the turns' requests
    cached_tokens: int = 0  # of those, served from the prefix cache
    budget_hit: bool = False

    def add(self, ids: list[int], lps: list[float], vers: list[int], trained: bool) -> None:
        self.ids += ids
        self.logprobs += lps
        self.versions += vers
        self.mask += [trained] * len(ids)


@dataclass
class Limits:
    """What bounds one episode: ``env.max_tokens`` (None: the model's length alone),
    ``actor.engine.max_model_len``, ``actor.sampling.max_tokens`` per turn."""

    max_tokens: int | None
    max_model_len: int
    turn_tokens: int

    def room(self, rec: Record) -> int:
        left = self.max_model_len - len(rec.prompt_ids) - len(rec.ids)
        if self.max_tokens is not None:
            left = min(left, self.max_tokens - len(rec.ids))
        return min(left, self.turn_tokens)


def as_dicts(messages: Any) -> list[dict]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
            for m in messages]  # fmt: skip


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls of ``text``
    (asyncrl/models/tool_calls.py; a block that is not such JSON: the env sees no call)."""
    return [ToolCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments))
            for c in HERMES.parse(text).calls]  # fmt: skip


class EngineClient(Client):
    """The part of a verifiers client its envs call (``get_response``), backed by the
    actor's engine for one episode: it records every token the engine saw into ``rec``."""

    def __init__(self, engine: Engine, rec: Record, params: Callable[[int], Sampling],
                 version: Callable[[], int], limits: Limits, aborted: type[Exception]):  # fmt: skip
        super().__init__(engine)
        self.rec, self.params, self.version, self.limits = rec, params, version, limits
        self.aborted = aborted
        self.tok = engine.get_tokenizer()

    def setup_client(self, config: Any) -> Any:
        raise VerifiersError("EngineClient is built from the actor's engine, not a config")

    async def close(self) -> None:
        return None

    async def to_native_tool(self, tool: Any) -> dict:
        return {"type": "function", "function": {"name": tool.name, "description":
                tool.description, "parameters": tool.parameters}}  # fmt: skip

    async def to_native_prompt(self, messages: Any) -> tuple[list[dict], dict]:
        return as_dicts(messages), {}

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip

    def extend(self, messages: list[dict], tools: list[dict] | None) -> None:
        """Append the request's new messages (mask 0) after the ids so far."""
        rec, text = self.rec, self.render(messages, tools)
        if not rec.turns:
            rec.prompt_ids = list(self.tok.encode(text, add_special_tokens=False))
        else:
            n = len(rec.seen)
            if len(messages) <= n + 1 or messages[:n] != rec.seen:
                raise VerifiersError("history rewritten: a turn's messages do not extend the last")
            if not text.startswith(rec.rendered + rec.generated):
                raise VerifiersError(
                    f"chat template of {getattr(self.tok, 'name_or_path', '?')} is not "
                    "append-only here, or renders the model's turn unlike its tokens"
                )
            ids = self.tok.encode(
                text[len(rec.rendered + rec.generated) :], add_special_tokens=False
            )
            v = rec.versions[-1] if rec.versions else self.version()
            rec.add(list(ids), [0.0] * len(ids), [v] * len(ids), False)
            rec.texts.append(text[len(rec.rendered + rec.generated) :])
        rec.seen, rec.rendered = messages, text

    async def get_native_response(self, prompt: list[dict], model: str, sampling_args: Any,
                                  tools: list[dict] | None = None, **kwargs: Any) -> Any:  # fmt: skip
        self.extend(prompt, tools)
        rec, room = self.rec, self.limits.room(self.rec)
        if room < 1:
            rec.budget_hit = True
            raise vf.OverlongPromptError("the episode's token budget is spent")
        sampling = replace(self.params(rec.turns), max_tokens=room)
        final = await self.engine.generate(
            rec.prompt_ids + rec.ids, sampling, uuid.uuid4().hex, version_salt(self.version())
        )
        if not final.completions or final.completions[0].finish_reason == "abort":
            raise self.aborted("a weight update aborted a verifiers episode's request")
        comp = final.completions[0]
        rec.turn_prompt_tokens += len(final.prompt_ids)
        rec.cached_tokens += final.cached_tokens
        ids = comp.token_ids.tolist()
        rec.add(ids, comp.logprobs.tolist(), comp.versions.tolist(), True)
        rec.turns += 1
        rec.generated = self.tok.decode(ids, skip_special_tokens=False)
        text = self.tok.decode(ids, skip_special_tokens=True)
        rec.texts.append(text)
        return text, comp.finish_reason, len(final.prompt_ids), len(ids)

    @property
    def engine(self) -> Any:
        return self.client

    async def raise_from_native_response(self, response: Any) -> None:
        return None

    async def from_native_response(self, response: Any) -> Response:
        text, finish, n_prompt, n_out = response
        calls = parse_tool_calls(text)
        self.rec.tool_calls += len(calls)
        message = ResponseMessage(
            content=text, tool_calls=calls or None, is_truncated=finish == "length",
            finish_reason="length" if finish == "length" else ("tool_calls" if calls else "stop"),
        )  # fmt: skip
        usage = Usage(prompt_tokens=n_prompt, reasoning_tokens=0, completion_tokens=n_out,
                      total_tokens=n_prompt + n_out)  # fmt: skip
        return Response(id=uuid.uuid4().hex, created=int(time.time()), model=MODEL_NAME,
                        usage=usage, message=message)  # fmt: skip


class VerifiersEpisodes:
    """An episode runner (``run_group(prompt) -> TrajectoryGroup``) over a verifiers env:
    the n samples of a prompt are n concurrent rollouts, one group."""

    def __init__(self, engine: Engine, task: VerifiersTask, n: int, limits: Limits,
                 timeout_s: float, params: Callable[[int, int, int], Sampling],
                 version: Callable[[], int], aborted: type[Exception]):  # fmt: skip
        self.engine, self.task, self.n, self.limits = engine, task, n, limits
        self.env = load_environment(task.id)
        self.timeout_s, self.params, self.version, self.aborted = (
            timeout_s,
            params,
            version,
            aborted,
        )
        self._groups = 0

    async def run_group(self, prompt: Prompt) -> TrajectoryGroup:
        index = self._groups
        self._groups += 1
        gid = f"{index:08x}{uuid.uuid4().hex[:16]}"
        row = self.task.row(int(prompt.meta["example_id"]))
        try:  # a TaskGroup: an aborted episode cancels its siblings (the group reruns)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._episode(prompt, row, gid, index, i))
                         for i in range(self.n)]  # fmt: skip
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        trajs = [t.result() for t in tasks]
        return TrajectoryGroup(gid, list(trajs))

    async def _episode(self, prompt: Prompt, row: dict, gid: str, index: int, i: int) -> Trajectory:
        t_start, rec = time.time(), Record()
        client = EngineClient(self.engine, rec, lambda turn: self.params(index, i, turn),
                              self.version, self.limits, self.aborted)  # fmt: skip
        reward, breakdown, finish, error = 0.0, {}, "done", ""
        try:
            reward, breakdown, finish = await asyncio.wait_for(
                self._rollout(client, row, rec), self.timeout_s
            )
        except TimeoutError:
            finish, error = (
                "env_error",
                f"TimeoutError: no answer within env.timeout_s={self.timeout_s}",
            )
        except self.aborted:
            raise
        except Exception as e:  # noqa: BLE001 - an env's failure is a recorded outcome
            finish, error = "env_error", f"{type(e).__name__}: {e}"
        if finish == "env_error":
            reward, breakdown = 0.0, {}
        return self._trajectory(rec, prompt, gid, i, t_start, reward, breakdown, finish, error)

    async def _rollout(self, client: EngineClient, row: dict, rec: Record) -> tuple:
        inp = {k: row[k] for k in ("prompt", "example_id", "answer", "info", "task") if k in row}
        state = await self.env.rollout(inp, client, MODEL_NAME, {})
        err = state.get("error")
        if err is not None:
            cause = err.__cause__ or err
            if isinstance(cause, self.aborted):
                raise cause
            raise VerifiersError(f"{type(cause).__name__}: {cause}")
        await self.env.rubric.score_group([state])
        reward = state.get("reward")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise VerifiersError(f"the rubric returned {reward!r}, not a finite number")
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()
                   if isinstance(v, int | float) and math.isfinite(v)}  # fmt: skip
        finish = "token_budget" if rec.budget_hit else "done"
        return float(reward), metrics, finish

    def _trajectory(self, rec: Record, prompt: Prompt, gid: str, i: int, t_start: float,
                    reward: float, breakdown: dict, finish: str, error: str) -> Trajectory:  # fmt: skip
        return Trajectory(
            traj_id=f"{gid}-{i}",
            group_id=gid,
            **token_fields(rec.prompt_ids, rec.ids, rec.logprobs, rec.versions, rec.mask),
            reward=reward,
            reward_breakdown=breakdown,
            finish_reason=finish,
            error=error,
            prompt_text=prompt.text,
            response_text="".join(rec.texts),
            t_start=t_start,
            t_end=time.time(),
            episode={
                "turns": float(rec.turns),
                "tool_calls": float(rec.tool_calls),
                "turn_prompt_tokens": float(rec.turn_prompt_tokens),
                "cached_tokens": float(rec.cached_tokens),
            },  # fmt: skip
        )


class VerifiersEnv:
    """``env._target_`` of ``env=verifiers``: names the verifiers env (``id``) and builds
    the runner that drives it (``episodes``); asyncrl's text ``reset``/``step`` loop is not
    used (verifiers runs its own turn loop)."""

    def __init__(self, id: str):
        self.id = id
        load_environment(id)  # a bad id fails at start-up

    def episodes(self, engine: Any, task: Any, n: int, limits: Limits, timeout_s: float,
                 params: Callable[[int, int, int], Any], version: Callable[[], int],
                 aborted: type[Exception]) -> VerifiersEpisodes:  # fmt: skip
        if not isinstance(task, VerifiersTask) or task.id != self.id:
            raise VerifiersError(f"env=verifiers needs task=verifiers with task.id={self.id}")
        return VerifiersEpisodes(engine, task, n, limits, timeout_s, params, version, aborted)
