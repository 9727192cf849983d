"""Images in a message-level env's messages (asyncrl/envs/messages.py ``ImagePart``): the
template renders an image part as the model's placeholder, the images reach the engine
and the trajectory as a text env's observation images do (asyncrl/actor/image_tokens.py),
and a model without a vision tower is refused. Real parts: the tiny VLM's processor and
tokenizer, the real multi-turn runner and chat renderer; the engine is the contract fake
(tests/fake_engine.py) reporting what the model's processor makes of each request's
placeholders, as vLLM's does (tests/test_vlm_fidelity.py checks vLLM itself agrees).
"""

from __future__ import annotations

import asyncio
import io
import random

import pytest
from chat_image_envs import IMAGE_TEMPLATE, TEXT_TEMPLATE, draw
from fake_engine import FakeEngine

from asyncrl.actor.env_runner import MultiTurnEpisodes
from asyncrl.actor.settings import ActorSettings
from asyncrl.config import ConfigError
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.envs.chat_turns import ChatRenderer
from asyncrl.envs.messages import ChatOptions, ImagePart, Message
from asyncrl.envs.settings import EnvSettings
from asyncrl.models.tiny_vlm import TinyVLMSpec, build_tiny_vlm, default_lm_spec, default_task
from asyncrl.trajectory import Image, from_bytes, to_bytes

ENVS = "tests.chat_image_envs"  # the envs' module as the repository root names it


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, tiny_model):
    spec = TinyVLMSpec.defaults(warm_start_steps=0, warm_start_read_steps=0)
    out = tmp_path_factory.mktemp("vlm") / "m"
    return build_tiny_vlm(out, default_task(), spec, default_lm_spec(), measure=False)


@pytest.fixture(scope="module")
def processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir)


def pil(png: bytes):
    from PIL import Image as PIL

    return PIL.open(io.BytesIO(png)).convert("RGB")


def expanded(processor, text: str, pngs: list[bytes]) -> list[int]:
    """What the model's processor (vLLM's too) makes of ``text`` and its images."""
    out = processor(text=text, images=[[pil(b) for b in pngs]], add_special_tokens=False)
    return out["input_ids"][0]


def sum_engine(processor, prompt) -> FakeEngine:
    """Asks for the picture of the prompt's sum (``a+b``) until the request shows two
    images, then answers the sum; its requests' ids are the processor's expansion."""
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    per_image = expanded(processor, "<image>", [prompt.meta["images"][0]]).count(image_id)
    ask = "+".join(map(str, prompt.meta["operands"]))

    def policy(ids: list[int]) -> str:
        return prompt.answer if ids.count(image_id) > per_image else ask

    def expand(ids: list[int], pngs: list[bytes]) -> list[int]:
        return expanded(processor, "".join(tok.convert_ids_to_tokens(ids)), pngs)

    return FakeEngine(tok, policy=policy, expand=expand)


def runner(engine, env_cls: str = "SumPictureEnv", n: int = 2, task=None) -> MultiTurnEpisodes:
    env = EnvSettings.from_config(
        {"_target_": f"{ENVS}.{env_cls}", "max_turns": 3, "max_tokens": 90,
         "timeout_s": 60}
    )  # fmt: skip
    settings = ActorSettings.defaults(sampling=SamplingSettings.defaults(n=n, max_tokens=8),
                                      engine=EngineSettings.defaults(max_model_len=160))  # fmt: skip
    return MultiTurnEpisodes(engine, task or default_task(), settings, env, lambda: 0)


def test_an_image_part_renders_as_the_models_placeholder_where_it_stands(processor):
    tok, png = processor.tokenizer, draw("7")
    user = Message("user", ["3+4=", ImagePart(png), "?"])
    assert user.as_dict() == {"role": "user", "content": [
        {"type": "text", "text": "3+4="}, {"type": "image"}, {"type": "text", "text": "?"}]}  # fmt: skip
    assert user.text == "3+4=?" and user.images == [png]
    # a text message is what it was: a string content, no images
    assert Message("user", "3+4=").as_dict() == {"role": "user", "content": "3+4="}
    assert Message("user", "3+4=").images == []
    with pytest.raises(TypeError, match="PNG bytes"):
        ImagePart(b"not a png")
    with pytest.raises(TypeError, match="strings or ImageParts"):
        Message("user", ["3", 4])

    r = ChatRenderer(tok, ChatOptions("calc", IMAGE_TEMPLATE), "tiny_vlm", "<image>")  # probed
    history = [user, Message("assistant", "3+4"),
               Message("tool", [ImagePart(png)], tool_call_id="call_0", name="draw_sum")]  # fmt: skip
    assert r.render(history, []) == "3+4=<image>?3+4<eos>=<image>"
    # a template that prints a content whole renders no placeholder: refused by the probe
    with pytest.raises(ValueError, match=r"renders 0 <image> for 1 image parts"):
        ChatRenderer(tok, ChatOptions("calc", TEXT_TEMPLATE), "tiny_vlm", "<image>")
    ChatRenderer(tok, ChatOptions("calc", TEXT_TEMPLATE), "tiny_vlm")  # text messages: fine


def test_a_tool_image_episode_is_the_incremental_render_expanded_exactly(processor, tmp_path):
    prompt = default_task().sample(random.Random(2))
    engine = sum_engine(processor, prompt)
    run = runner(engine)
    group = asyncio.run(run.run_group(prompt))
    tok = processor.tokenizer
    image_id, eos = tok.convert_tokens_to_ids("<image>"), tok.eos_token_id
    ask = "+".join(map(str, prompt.meta["operands"]))
    sum_png = draw(prompt.answer)
    call = [*tok.encode(ask, add_special_tokens=False), eos]
    answer = [*tok.encode(prompt.answer, add_special_tokens=False), eos]
    full = f"<image>{ask}<eos>=<image>{prompt.answer}<eos>"  # the template's whole render
    for t in group.trajectories:
        assert t.finish_reason == "done" and t.error == "" and t.reward == 1.0
        assert t.episode["tool_calls"] == 1.0 and t.episode["turns"] == 2.0
        assert [im.png for im in t.images] == [prompt.meta["images"][0], sum_png]
        # the whole episode is what the processor makes of the whole render and images
        pngs = [im.png for im in t.images]
        assert t.prompt_ids.tolist() + t.response_ids.tolist() == expanded(processor, full, pngs)
        assert t.prompt_ids.tolist() == expanded(processor, "<image>", pngs[:1])
        tool = expanded(processor, "=<image>", pngs[1:])  # the tool message: not trained
        assert len(tool) == 1 + 3 + TinyVLMSpec.defaults().image_seq_len  # "=" and the image's
        assert t.response_ids.tolist() == call + tool + answer
        trained = [True] * len(call) + [False] * len(tool) + [True] * len(answer)
        assert t.loss_mask.tolist() == trained
        assert (t.behaviour_logprobs[~t.loss_mask] == 0).all()
        assert t.prompt_text == "<image>" and t.response_text == f"{ask}=<image>{prompt.answer}"
    # the requests: the compact render (one placeholder per image) and every image so far
    assert engine.requests[0] == [image_id] and engine.images[0] == [prompt.meta["images"][0]]
    assert engine.requests[2] == [image_id, *call, *tok.encode("=", add_special_tokens=False),
                                  image_id]  # fmt: skip
    assert tok.decode(engine.requests[2] + engine.outputs[2], skip_special_tokens=False) == full
    assert engine.images[2] == [prompt.meta["images"][0], sum_png]
    back = from_bytes(to_bytes(group.trajectories))
    assert [im.key for im in back[0].images] == [Image.of(b).key for b in engine.images[2]]


def test_a_text_models_run_is_refused_and_an_undeclared_env_ends_env_error(tiny_model, task):
    env = EnvSettings.from_config({"_target_": f"{ENVS}.SumPictureEnv", "max_turns": 3})
    with pytest.raises(ConfigError, match=r"shows images in its messages, and .*tiny-.*: "
                       "the model's processor takes no images: set model=tiny_vlm"):  # fmt: skip
        env.check_template(str(tiny_model))
    from transformers import AutoTokenizer

    prompt = task.sample(random.Random(3))  # the text model's task: no images of its own
    engine = FakeEngine(AutoTokenizer.from_pretrained(tiny_model), policy=lambda ids: "1+2")
    group = asyncio.run(runner(engine, "UndeclaredSumPictureEnv", 1, task).run_group(prompt))
    (t,) = group.trajectories
    assert t.finish_reason == "env_error" and "the model's processor takes no images" in t.error
    assert t.images == [] and t.prompt_ids.size > 0  # a text prompt for the text model
    assert engine.requests == []  # ended before any request


def test_a_template_that_drops_image_parts_ends_the_episode_env_error(processor):
    """An env that does not declare its images gets no start-up probe: a template that
    renders no placeholder for them fails the episode, naming the count."""
    prompt = default_task().sample(random.Random(4))
    engine = sum_engine(processor, prompt)
    group = asyncio.run(runner(engine, "TextTemplateEnv", n=1).run_group(prompt))
    (t,) = group.trajectories
    assert t.finish_reason == "env_error" and "0 <image> placeholders for 1 images" in t.error


def test_start_up_takes_a_vlm_whose_template_renders_image_parts(vlm_dir):
    ok = EnvSettings.from_config({"_target_": f"{ENVS}.SumPictureEnv", "max_turns": 3})
    ok.check_template(str(vlm_dir))  # the probe with an image renders append-only
    bad = EnvSettings.from_config(
        {"_target_": f"{ENVS}.SumPictureEnv", "max_turns": 3, "chat_template": TEXT_TEMPLATE}
    )
    with pytest.raises(ConfigError, match=r"SumPictureEnv: .*renders 0 <image> for 1 image"):
        bad.check_template(str(vlm_dir))
