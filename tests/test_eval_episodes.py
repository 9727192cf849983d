"""Held-out evaluation of a run whose env takes turns (asyncrl/eval/actor.py SetScorer):
each prompt runs as whole episodes through the actor's runner on the session's vLLM
engine, and the figures are the env's rewards and tool calls; the single-turn path
scores the same greedy answers alike. On a scripted engine: at most
``eval.max_inflight_groups`` episode groups run at once, so an env slower than nothing
but within ``env.timeout_s`` does not time out however many prompts wait."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from fake_engine import FakeEngine

from asyncrl.actor.settings import ActorSettings
from asyncrl.engine.protocol import text_sampling
from asyncrl.engine.settings import EngineSettings
from asyncrl.envs.base import StepResult
from asyncrl.envs.calculator import ALPHABET, CalculatorTask
from asyncrl.envs.messages import ChatEnv, Message, MessageStep, Opening
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.actor import SetScorer
from asyncrl.eval.settings import EvalSettings
from asyncrl.eval.split import heldout_prompts
from asyncrl.models.tiny import build_tokenizer
from asyncrl.tasks.base import Prompt, ascore

# the tiny model's chat: each message's content, the model's turns ended by EOS (so the
# rendered prompt is the task's prompt text, token for token)
CONTENT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}"
    "{{ eos_token }}{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
)
MAX_TOKENS = 6
SEEN: list[tuple[str, int, str]] = []  # (prompt, turn, the assistant's text) per step


class ScriptedToolEnv(ChatEnv):
    """Two turns: the first is scored by the task's reward and counts one tool call when
    the prompt's answer is even (a property of the prompt, so the test knows the share);
    a user message follows, and the second turn ends the episode."""

    def __init__(self):
        super().__init__(tool_format="calc", chat_template=CONTENT_TEMPLATE)
        self.turn = 0

    async def reset(self, sample, task) -> Opening:
        self.sample, self.task = sample, task
        return Opening([Message("user", sample.text)])

    async def step(self, message: Message) -> MessageStep:
        self.turn += 1
        SEEN.append((self.sample.text, self.turn, message.text))
        if self.turn == 2:
            return MessageStep(done=True)
        reward = (await ascore(self.task, self.sample, message.text))[0]
        calls = int(int(self.sample.answer) % 2 == 0)
        return MessageStep(messages=[Message("user", "12+12=")], reward=reward, tool_calls=calls)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_turn_taking_env_is_evaluated_as_greedy_episodes(vllm_actor, task):
    engine = vllm_actor.engine
    settings = EvalSettings.defaults(k=2)
    prompts = heldout_prompts(task, 0.1, 1, 8)
    env = EnvSettings.defaults(target=f"{__name__}.ScriptedToolEnv", max_turns=3, max_tokens=56)
    actor = vllm_actor.settings
    SEEN.clear()
    episodes = SetScorer(engine, settings, MAX_TOKENS, 0, actor, env)
    texts = SetScorer(engine, settings, MAX_TOKENS, 0, actor, None)
    assert episodes.episodes and not texts.episodes
    got = await episodes.score(task, prompts)
    # what the engine answers greedily to each prompt, asked directly
    greedy_texts = []
    for p in prompts:
        out = await engine.generate(p.text, text_sampling(0.0, MAX_TOKENS), f"t-{p.text}")
        greedy_texts.append(out.completions[0].text)
    greedy = [(await ascore(task, p, t))[0] for p, t in zip(prompts, greedy_texts)]
    n = len(prompts)
    assert n >= 4
    assert got["prompts"] == n
    assert got["pass@1"] == pytest.approx(sum(r >= 1.0 for r in greedy) / n)
    assert got["reward_mean"] == pytest.approx(sum(greedy) / n)
    even = sum(int(p.answer) % 2 == 0 for p in prompts)
    assert got["tool_call_share"] == pytest.approx(even / n)
    # every episode (1 greedy + k sampled per prompt) ran both turns through the env; the
    # sampled ones' first turns are the first turns less the greedy one
    passed_k = 0
    for p, g in zip(prompts, greedy_texts):
        assert sorted(t for q, t, _ in SEEN if q == p.text) == sorted([1, 2] * (1 + settings.k))
        firsts = [text for q, t, text in SEEN if q == p.text and t == 1]
        firsts.remove(g)
        scores = [(await ascore(task, p, text))[0] for text in firsts]
        passed_k += any(r >= 1.0 for r in scores)
    assert got["pass@k"] == pytest.approx(passed_k / n)
    # the single-turn path: the same greedy answers, no tool-call figure
    single = await texts.score(task, prompts)
    assert single["pass@1"] == got["pass@1"] and "tool_call_share" not in single


TOK = build_tokenizer(ALPHABET)


class ToolService:
    """A tool behind its own process, serving ``workers`` calls at once, each ``seconds``
    long (a sandbox pool on a 2-core host); ``open`` counts the sessions open per prompt
    (reset to close)."""

    def __init__(self, workers: int, seconds: float):
        self.slots, self.seconds = asyncio.Semaphore(workers), seconds
        self.open: Counter[str] = Counter()
        self.most_prompts = self.most_sessions = self.served = 0

    def opened(self, text: str) -> None:
        self.open[text] += 1
        self.most_prompts = max(self.most_prompts, len(+self.open))
        self.most_sessions = max(self.most_sessions, self.open.total())

    async def call(self) -> None:
        async with self.slots:
            await asyncio.sleep(self.seconds)
        self.served += 1


SERVICE: ToolService | None = None


class ServiceEnv:
    """One tool call per episode: the answer passes once the service has served it."""

    async def reset(self, sample, task):
        self.text = sample.text
        SERVICE.opened(self.text)

    async def step(self, text, ids):
        await SERVICE.call()
        return StepResult(reward=1.0, done=True)

    async def close(self):
        SERVICE.open[self.text] -= 1


def episodes_scorer(bound: int, k: int, timeout_s: float) -> SetScorer:
    engine = FakeEngine(TOK, policy=lambda ids: "12")
    settings = EvalSettings.defaults(k=k, max_inflight_groups=bound)
    actor = ActorSettings.defaults(engine=EngineSettings.defaults(max_model_len=64))
    env = EnvSettings.defaults(target=f"{__name__}.ServiceEnv", max_turns=2, timeout_s=timeout_s)
    return SetScorer(engine, settings, 8, 0, actor, env)


PROMPTS = [Prompt(f"{a}+{a}=", str(2 * a)) for a in range(10)]


def test_at_most_max_inflight_groups_episode_groups_run_at_once():
    """10 prompts, k=2: 20 groups, 2 at a time. A prompt's greedy and sampled groups are
    never in flight together (10 groups apart), so the prompts with a session open count
    the groups; every episode still runs, and the results keep their order."""
    global SERVICE
    SERVICE = ToolService(workers=100, seconds=0.01)
    got = asyncio.run(episodes_scorer(2, 2, 10.0).score(CalculatorTask(), PROMPTS))
    assert SERVICE.most_prompts == 2 and SERVICE.most_sessions <= 2 * 2
    assert SERVICE.served == 10 * (1 + 2) and not +SERVICE.open
    assert got == {"pass@1": 1.0, "pass@k": 1.0, "reward_mean": 1.0, "tool_call_share": 0.0,
                   "prompts": 10.0}  # fmt: skip


def test_a_slow_tool_within_the_env_timeout_does_not_time_out_behind_queued_episodes():
    """A tool serving 2 calls at once, 0.2 s each, and env.timeout_s=1: the 30 episodes of
    10 prompts (k=2) need 3 s of the tool, so started all at once the later ones would
    time out waiting for it; 2 groups at a time, each episode waits at most one call."""
    global SERVICE
    SERVICE = ToolService(workers=2, seconds=0.2)
    got = asyncio.run(episodes_scorer(2, 2, 1.0).score(CalculatorTask(), PROMPTS))
    assert SERVICE.served == 30  # every episode's call answered: none timed out
    assert got["pass@1"] == got["pass@k"] == got["reward_mean"] == 1.0
