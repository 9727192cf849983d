"""Held-out evaluation of a run whose env takes turns (asyncrl/eval/actor.py SetScorer):
each prompt runs as whole episodes through the actor's runner on the session's vLLM
engine, and the figures are the env's rewards and tool calls; the single-turn path
scores the same greedy answers alike."""

from __future__ import annotations

import pytest

from asyncrl.engine.protocol import text_sampling
from asyncrl.envs.messages import ChatEnv, Message, MessageStep, Opening
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.actor import SetScorer
from asyncrl.eval.settings import EvalSettings
from asyncrl.eval.split import heldout_prompts
from asyncrl.tasks.base import ascore

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
