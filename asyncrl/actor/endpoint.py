"""An OpenAI-compatible chat endpoint per actor, served by the actor's own engine, that
records every call of a black-box agent's episode (asyncrl/actor/agent_log.py).

    POST http://127.0.0.1:PORT/episodes/<episode id>/v1/chat/completions
         Authorization: Bearer <token>          (401 without it, 403 from off loopback)
      messages (+ tools) ─▶ the chat template ─▶ text ─▶ EpisodeLog.plan
      ─▶ engine.generate(branch ids + segment ids, n choices)
      ─▶ each choice recorded on a branch ─▶ the OpenAI response (content, tool calls
         parsed from ``<tool_call>{json}</tool_call>``, optional per-token log-probs)
    what waits: the engine's requests, on the actor's event loop (aiohttp runs there,
    no thread); nothing else.

Sampling is the actor's (``actor.sampling``: temperature, top-p, top-k), whatever the
request asks, so the behaviour log-probs are those the learner's ratios assume; a
request's ``max_tokens`` / ``max_completion_tokens`` and ``n`` are honoured, within
``actor.sampling.max_tokens``, ``env.max_tokens`` and the model's length. ``stream``
is refused (400). Each request carries the version salt of the weights it starts on.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from asyncrl.actor.agent_log import Branch, EpisodeLog, Plan
from asyncrl.actor.episode import turn_sampling
from asyncrl.engine.protocol import Completion, Engine, Generation, Sampling, version_salt
from asyncrl.models.tool_calls import HERMES

HOST = "127.0.0.1"
MAX_N = 16  # choices per call: each is a branch (a trajectory) of the episode


def loopback(host: str | None) -> bool:
    """Whether a peer address is on 127.0.0.0/8 or ::1."""
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool calls) of a completion, read in the Hermes / SmolLM2 format
    (asyncrl/models/tool_calls.py); the text outside the calls is the content (None if
    empty). A block that is not such JSON stays in the content."""
    parsed = HERMES.parse(text)
    return (parsed.content or None), [c.openai() for c in parsed.calls]


class AgentEndpoint:
    """The actor's endpoint. ``open(id)`` before an agent's episode, ``close(id)`` after
    (its EpisodeLog); a request for an episode not open is a 404."""

    def __init__(
        self,
        engine: Engine,
        sampling: Sampling,  # the actor's (n=1)
        version: Callable[[], int],
        max_model_len: int,
        max_tokens: int | None,  # env.max_tokens: response tokens per branch
        max_calls: int,  # env.max_turns: calls per episode
        chat_template: str | None = None,  # None: the tokenizer's own
    ):
        self.engine, self.sampling, self.version = engine, sampling, version
        self.max_model_len, self.max_tokens, self.max_calls = max_model_len, max_tokens, max_calls
        self.chat_template = chat_template
        self.token = secrets.token_urlsafe(24)
        self.logs: dict[str, EpisodeLog] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tokenizer: Any = None

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port (once)."""
        if self._runner is not None:
            return
        app = web.Application(middlewares=[self.guard])
        app.router.add_post("/episodes/{eid}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{eid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))  # a free port, known before the server starts
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, eid: str) -> str:
        return f"http://{HOST}:{self.port}/episodes/{eid}/v1"

    def open(self, eid: str, group: int = 0, sample: int = 0) -> EpisodeLog:
        self.logs[eid] = EpisodeLog(eid, group, sample)
        return self.logs[eid]

    def close(self, eid: str) -> EpisodeLog:
        log = self.logs.pop(eid)
        log.closed = True
        return log

    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not loopback(request.remote):
            return error_response(403, "the endpoint serves loopback clients only")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return error_response(401, "missing or wrong bearer token")
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        log = self.logs.get(request.match_info["eid"])
        if log is None:
            return error_response(404, "no such episode (not started, or finished)")
        try:
            body = await request.json()
            return web.json_response(await self.complete(log, body))
        except RequestError as e:
            return error_response(e.status, str(e))
        except (ValueError, TypeError, KeyError) as e:
            return error_response(400, f"bad request: {type(e).__name__}: {e}")

    async def complete(self, log: EpisodeLog, body: dict) -> dict:
        """One chat completion on ``log``: recorded, answered as OpenAI's JSON."""
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported by this endpoint")
        if log.calls >= self.max_calls:
            raise RequestError(400, f"the episode made env.max_turns={self.max_calls} calls")
        n = int(body.get("n") or 1)
        if not 1 <= n <= MAX_N:
            raise RequestError(400, f"n={n}: expected 1..{MAX_N}")
        text = self.render(body["messages"], body.get("tools"))
        plan = log.plan(text)
        prompt, seg_ids = self._prompt(plan)
        room = self._room(plan.base, len(prompt), len(seg_ids), body)
        log.calls += 1
        sampling = turn_sampling(self.engine, self.sampling, log.group, log.sample, log.calls - 1)
        sampling = replace(sampling, n=n, max_tokens=room)
        rid = f"agent-{log.episode_id}-{log.calls}"
        final = await self.engine.generate(prompt, sampling, rid, version_salt(self.version()))
        if not final.completions or final.aborted:
            log.aborted = True
            raise RequestError(503, "a weight update aborted this request")
        if log.closed:
            raise RequestError(404, "the episode ended while this request ran")
        outs = sorted(final.completions, key=lambda c: c.index)
        branches = self._branches(log, plan, seg_ids, len(outs))
        lps = bool(body.get("logprobs"))
        choices = [
            self._record(b, c, final, k == 0, lps) for k, (b, c) in enumerate(zip(branches, outs))
        ]
        used = sum(len(c.token_ids) for c in final.completions)
        return {
            "id": f"chatcmpl-{log.episode_id}-{log.calls}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "policy")),
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": used,
                      "total_tokens": len(prompt) + used},
        }  # fmt: skip

    def _prompt(self, plan: Plan) -> tuple[list[int], list[int]]:
        """(the request's token ids, the segment's ids): a base branch's tokens and the
        segment tokenized alone, or (a fork) the whole render tokenized."""
        seg_ids = self.tokenizer.encode(plan.segment, add_special_tokens=False)
        if plan.base is None:
            return list(seg_ids), list(seg_ids)
        return plan.base.tokens + list(seg_ids), list(seg_ids)

    def _room(self, base: Branch | None, prompt_len: int, seg_len: int, body: dict) -> int:
        """Tokens this call may generate (a RequestError if none)."""
        room = min(self.max_model_len - prompt_len, int(self.sampling.max_tokens))
        if self.max_tokens is not None:
            room = min(room, self.max_tokens - (len(base.ids) + seg_len if base else 0))
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            room = min(room, int(asked))
        if room < 1:
            raise RequestError(400, "the episode's token budget is spent (env.max_tokens)")
        return room

    def _branches(self, log: EpisodeLog, plan: Plan, seg_ids: list[int], n: int) -> list[Branch]:
        """The branch each of a call's ``n`` choices goes on: the base extended by the
        segment (or a fork) for the first, a sibling with the same prefix for each other."""
        if plan.base is None:
            head = log.start(seg_ids, plan.segment)
        else:
            head = log.take(plan)
            head.add_segment(seg_ids, plan.segment, self.version())
        return [head] + [log.spawn(head) for _ in range(n - 1)]

    def _record(
        self, branch: Branch, comp: Completion, final: Generation, first: bool, lps: bool
    ) -> dict:
        """Record one choice on its branch and answer it (OpenAI's choice object)."""
        ids, logps = comp.token_ids, comp.logprobs
        raw = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        shown = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        branch.add_completion(ids, logps, comp.versions, raw, shown)
        branch.prompt_tokens += len(final.prompt_ids)
        if first:  # the request's cache hits, counted once
            branch.cached_tokens += final.cached_tokens
        content, calls = parse_tool_calls(shown)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else ("length" if comp.finish_reason == "length" else "stop")
        out: dict[str, Any] = {"index": comp.index, "message": message, "finish_reason": finish,
                               "logprobs": None}  # fmt: skip
        if lps:
            out["logprobs"] = {"content": [
                {"token": self.tokenizer.decode([int(t)]), "logprob": float(lp),
                 "bytes": list(self.tokenizer.decode([int(t)]).encode()), "top_logprobs": []}
                for t, lp in zip(ids, logps)
            ]}  # fmt: skip
        return out

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The chat template's text of ``messages`` with the assistant's generation prompt."""
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages: expected a non-empty list")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs)
        except (ValueError, TemplateError) as e:  # no template, or one that refuses these
            msg = f"the chat template cannot render these messages (env.chat_template): {e}"
            raise RequestError(400, msg) from None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.engine.get_tokenizer()
        return self._tokenizer
