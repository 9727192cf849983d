"""Multi-turn episodes on a scripted engine (no vLLM): the calculator env end to end,
masks and versions per token, every finish reason, aborted turns, config errors."""

from __future__ import annotations

import asyncio
import string

import numpy as np
import pytest
from fake_engine import FakeEngine

from asyncrl.actor.env_runner import MultiTurnEpisodes, make_runner
from asyncrl.actor.episode import EpisodeAborted, SingleTurnEpisodes, turn_seed
from asyncrl.actor.settings import ActorSettings
from asyncrl.config import ConfigError
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.envs.base import StepResult
from asyncrl.envs.calculator import ALPHABET, CalculatorEnv, CalculatorTask, evaluate
from asyncrl.envs.settings import EnvSettings
from asyncrl.models.tiny import build_tokenizer
from asyncrl.tasks.base import Prompt
from asyncrl.train import episode_means

TOK = build_tokenizer(ALPHABET)


class ScriptedEngine(FakeEngine):
    """``policy(prompt_ids) -> text`` answers each request (then EOS), log-prob -0.5; the
    version it labels changes when the test says so; every request past the first four
    prompt tokens reads them from the cache."""

    def __init__(self, policy, version: int = 0, tok=TOK):
        super().__init__(tok, policy, logprob=-0.5, cached=lambda ids: max(0, len(ids) - 4))
        self.version = version

    @property
    def seeds(self) -> list[int | None]:  # each request's sampling seed
        return [s.seed for s in self.samplings]


def calculator_policy(ids: list[int]) -> str:
    """Calls the tool on the prompt, then copies the tool's result."""
    text = TOK.decode(ids, skip_special_tokens=True)
    if "<calc>" not in text:
        return f"<calc>{text.rstrip('=')}</calc>"
    return text.rsplit("=", 1)[1]


def runner(engine, env: EnvSettings, n: int = 2, max_tokens: int = 20, max_len: int = 64):
    settings = ActorSettings.defaults(
        sampling=SamplingSettings.defaults(n=n, max_tokens=max_tokens),
        engine=EngineSettings.defaults(max_model_len=max_len),
    )
    return MultiTurnEpisodes(engine, CalculatorTask(), settings, env, lambda: engine.version)


CALC = EnvSettings.defaults(
    target="asyncrl.envs.calculator.CalculatorEnv", max_turns=3, max_tokens=56
)


def test_calculator_episode_is_exact_and_masks_the_tool_output():
    engine = ScriptedEngine(calculator_policy)
    group = asyncio.run(runner(engine, CALC).run_group(Prompt("37*48=", "1776")))
    assert len(group.trajectories) == 2
    for t in group.trajectories:
        assert t.reward == 1.0 and t.finish_reason == "done" and not t.error
        assert t.response_text == "<calc>37*48</calc>=17761776"
        call = TOK.encode("<calc>37*48</calc>") + [TOK.eos_token_id]
        obs = TOK.encode("=1776", add_special_tokens=False)
        final = TOK.encode("1776") + [TOK.eos_token_id]
        assert t.response_ids.tolist() == call + obs + final
        assert t.loss_mask.tolist() == [True] * len(call) + [False] * len(obs) + [True] * 5
        assert (t.behaviour_logprobs[~t.loss_mask] == 0).all()
        assert (t.behaviour_logprobs[t.loss_mask] == -0.5).all()
        assert t.episode["turns"] == 2 and t.episode["tool_calls"] == 1
        assert t.reward_breakdown["tool_used"] == 1.0
    # turn 2's request: the prompt, turn 1's ids and the observation's, as generated
    assert engine.requests[-1] == TOK.encode("37*48=") + call + obs


def test_a_recording_engine_s_routes_cover_the_whole_episode():
    """A multi-turn trajectory carries its last turn's routed experts: that request read
    the prompt, every turn and every observation, so they cover every position but the
    last token's."""
    engine = ScriptedEngine(calculator_policy)
    engine.routes = (2, 2)
    group = asyncio.run(runner(engine, CALC).run_group(Prompt("37*48=", "1776")))
    for t in group.trajectories:
        assert t.episode["turns"] == 2
        assert t.routed_experts.shape == (t.num_tokens - 1, 2, 2)
        assert t.routed_experts[:, 1, 1].tolist() == list(range(t.num_tokens - 1))


def test_every_turn_request_has_its_own_seed():
    """Seeded as vLLM seeds a request: from the engine's seed (the run's), the group's
    place in the actor's start order, the sample and the turn; a fresh runner on an
    engine of the same seed asks for the same seeds, another seed for none of them."""

    def seeds(engine_seed: int) -> list[int]:
        engine = ScriptedEngine(calculator_policy)
        engine.seed = engine_seed
        r = runner(engine, CALC, n=3)
        for prompt in (Prompt("37*48=", "1776"), Prompt("12*11=", "132")):
            asyncio.run(r.run_group(prompt))
        return engine.seeds

    first = seeds(5)
    want = {turn_seed(5, g, i, t) for g in range(2) for i in range(3) for t in range(2)}
    assert len(first) == 12 and set(first) == want  # 2 groups x 3 samples x 2 turns
    assert sorted(seeds(5)) == sorted(first)
    assert not set(seeds(6)) & set(first)
    plain = ScriptedEngine(calculator_policy)  # an engine with no seed: unseeded requests
    asyncio.run(runner(plain, CALC, n=1).run_group(Prompt("2*3=", "6")))
    assert plain.seeds == [None, None]


def test_versions_across_an_update_between_turns():
    engine = ScriptedEngine(calculator_policy, version=3)
    real = engine.policy

    def policy(ids):
        if len(engine.requests) == 2:  # an update landed between turns 1 and 2
            engine.version = 4
        return real(ids)

    engine.policy = policy
    t = asyncio.run(runner(engine, CALC, n=1).run_group(Prompt("12*11=", "132"))).trajectories[0]
    n1 = int(np.argmin(t.loss_mask))
    assert (t.versions[:n1] == 3).all() and (t.versions[~t.loss_mask] == 3).all()
    assert (t.versions[t.loss_mask][n1:] == 4).all()
    assert t.min_version == 3 and t.max_version == 4


class Raising:
    async def reset(self, sample, task):
        pass

    async def step(self, text, ids):
        raise KeyError("boom")


class RaisingAtReset(Raising):
    async def reset(self, sample, task):
        raise ConnectionError("no server")


class SlowReset(Raising):
    async def reset(self, sample, task):
        await asyncio.sleep(10)


class Slow(Raising):
    async def step(self, text, ids):
        await asyncio.sleep(10)


class Talkative(Raising):
    async def step(self, text, ids):
        return StepResult(observation="=1", reward=0.25)


@pytest.mark.parametrize(
    "target,limits,finish,reward",
    [
        (f"{__name__}.Raising", {}, "env_error", 0.0),
        (f"{__name__}.Slow", {"timeout_s": 0.05}, "timeout", 0.0),
        (f"{__name__}.Talkative", {"max_turns": 3}, "max_turns", 0.75),
        (f"{__name__}.Talkative", {"max_turns": 9, "max_tokens": 12}, "token_budget", 0.75),
    ],
)
def test_every_truncation_says_why(target, limits, finish, reward):
    engine = ScriptedEngine(lambda ids: "12")
    env = EnvSettings.defaults(target=target, **{"max_turns": 2, **limits})
    t = asyncio.run(runner(engine, env, n=1).run_group(Prompt("1*2=", "2"))).trajectories[0]
    assert t.finish_reason == finish and t.reward == reward
    assert bool(t.error) == (finish == "env_error")
    assert len(t.response_ids) <= env.max_tokens if env.max_tokens else True


@pytest.mark.parametrize(
    "target,finish",
    [(f"{__name__}.RaisingAtReset", "env_error"), (f"{__name__}.SlowReset", "timeout")],
)
def test_an_episode_ended_before_its_first_request_keeps_its_prompt(target, finish):
    """An env that fails or hangs in reset: the episode ends with no turn, and its
    trajectory still holds the prompt's ids (the learner needs a prompt), no response."""
    engine = ScriptedEngine(lambda ids: "12")
    env = EnvSettings.defaults(target=target, max_turns=2, timeout_s=0.05)
    t = asyncio.run(runner(engine, env, n=1).run_group(Prompt("1*2=", "2"))).trajectories[0]
    assert t.finish_reason == finish and t.reward == 0.0 and engine.requests == []
    assert t.prompt_ids.tolist() == TOK.encode("1*2=", add_special_tokens=False)
    assert len(t.response_ids) == 0


def test_calculator_refuses_bad_calls_and_too_many():
    async def go(texts):
        env = CalculatorEnv(max_calls=1)
        await env.reset(Prompt("2*3=", "6"), CalculatorTask())
        return [await env.step(t, []) for t in texts]

    ok, again = asyncio.run(go(["<calc>2*3</calc>", "<calc>2*3</calc>"]))
    assert ok.observation == "=6" and not ok.done and again.done and again.reward == 0
    (bad,) = asyncio.run(go(["<calc>2*</calc>"]))
    assert bad.done and bad.reward == 0 and bad.observation is None
    (two,) = asyncio.run(go(["6 6"]))  # one final answer, digits only
    assert two.done and two.reward == 0
    assert evaluate("2+3*4+1") == 15


def test_an_aborted_turn_reruns_the_group():
    engine = ScriptedEngine(calculator_policy)
    engine.abort = True
    with pytest.raises(EpisodeAborted):
        asyncio.run(runner(engine, CALC).run_group(Prompt("37*48=", "1776")))


def test_env_config_is_checked_before_ray():
    assert EnvSettings.from_config(None).single_turn
    with pytest.raises(ConfigError, match="env._target_"):
        EnvSettings.from_config({"_target_": "asyncrl.envs.nope.Env"})
    with pytest.raises(ConfigError, match="max_callz"):
        EnvSettings.from_config({"_target_": CALC.target, "max_callz": 2})
    with pytest.raises(ConfigError, match="env.max_turns"):
        EnvSettings.from_config({"_target_": CALC.target, "max_turns": 0})
    with pytest.raises(ConfigError, match="env.max_turns"):
        EnvSettings.from_config({"_target_": "asyncrl.envs.base.SingleTurnEnv", "max_turns": 2})
    s = EnvSettings.from_config({"_target_": CALC.target, "max_turns": 3, "max_calls": 1})
    assert s.kwargs == {"max_calls": 1} and s.make().max_calls == 1


def test_shipped_env_configs_compose():
    from hydra import compose, initialize_config_dir

    from asyncrl.train import CONF_DIR

    with initialize_config_dir(CONF_DIR, version_base=None):
        default = compose("config")
        calc = compose("config", overrides=["env=calculator"])
        code = compose("config", overrides=["env=code", "sandbox.workers=3"])
    assert EnvSettings.from_config(default.env).single_turn
    assert default.max_steps == 300  # an env's own max_steps does not leak into the default
    s = EnvSettings.from_config(calc.env)
    assert s.max_turns >= 2 and calc.actor.engine.enable_prefix_caching
    assert calc.task._target_.endswith("CalculatorTask")
    assert calc.max_steps == 60 and calc.learner.batch_groups == 8  # the plain run's
    task = CalculatorTask(**{k: v for k, v in calc.task.items() if k != "_target_"})
    assert task.header == ""  # the header's model never learned the tool format (docs/envs.md)
    with_header = CalculatorTask(header="Multiply. Tool: <calc>a*b</calc> gives =a*b. ")
    assert len(with_header.header) >= 32 and set(with_header.header) <= set(with_header.alphabet)
    c = EnvSettings.from_config(code.env, code.sandbox)
    assert c.sandbox.workers == 3 and c._pool is None  # the pool is the actor's, not the driver's
    assert code.task.sandbox.workers == 3  # task=code grades with sandbox.* itself
    engine = ScriptedEngine(calculator_policy)
    settings = ActorSettings.from_config(default.actor)
    assert isinstance(make_runner(engine, None, settings, None, int), SingleTurnEpisodes)


def test_summary_means():
    stats = {
        "a": {"trajectories": 4, "episode": {"turns": 8.0, "tool_calls": 4.0,
                                             "turn_prompt_tokens": 100.0, "cached_tokens": 25.0}},
    }  # fmt: skip
    assert episode_means(stats) == {
        "turns_mean": 2.0, "tool_calls_mean": 1.0, "prefix_cache_hit_rate_mean": 0.25,
    }  # fmt: skip
    single = episode_means({"a": {"trajectories": 3, "episode": {}}})
    assert single["turns_mean"] == 1.0 and single["prefix_cache_hit_rate_mean"] is None


def _code_policy(attempts: dict):
    """First attempt wrong, second right (the reference), for every problem."""

    def policy(ids: list[int]) -> str:
        text = CODE_TOK.decode(ids, skip_special_tokens=True)
        name, sig = text[2:].split("(", 1)[0], text.split("(", 1)[1].split(")", 1)[0]
        from asyncrl.envs.code import PROBLEMS

        body = next(p[3] for p in PROBLEMS if p[0] == name)
        attempts[name] = attempts.get(name, 0) + 1
        return f"def {name}({sig}): return {body if attempts[name] > 1 else 'None'}"

    return policy


CODE_TOK = build_tokenizer(string.printable)


@pytest.mark.slow
def test_code_env_grades_in_the_sandbox_with_a_scripted_policy():
    pytest.importorskip("asyncrl.sandbox")
    from asyncrl.envs.code import CodeTask

    engine = ScriptedEngine(_code_policy({}), tok=CODE_TOK)
    env = EnvSettings.defaults(target="asyncrl.envs.code.CodeEnv", max_turns=2, max_tokens=200)
    settings = ActorSettings.defaults(
        sampling=SamplingSettings.defaults(n=1, max_tokens=80),
        engine=EngineSettings.defaults(max_model_len=256),
    )
    r = MultiTurnEpisodes(engine, CodeTask(), settings, env, lambda: 0)
    cases = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(2, 2)", "expected": 4}]
    prompt = Prompt("# add(a, b): the sum of a and b\n", "", meta={"cases": cases})
    t = asyncio.run(r.run_group(prompt)).trajectories[0]
    assert t.reward == 1.0 and t.finish_reason == "done", (t.response_text, t.error)
    assert "# passed 0/2" in t.response_text and t.episode["turns"] == 2
    assert not t.loss_mask.all() and t.loss_mask.any()
