"""Chat form of the tasks: prompts through a model's chat template, chat-style answers
read by their final number; the tiny model (no template) keeps the plain form. The
template here is SmolLM2's (ChatML) on the tiny tokenizer: no 135M model needed."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import CHATML

from asyncrl.config import ConfigError
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.chat import final_answer
from asyncrl.tasks.jsonl import JsonlTask


@pytest.mark.parametrize(
    "text, want",
    [
        ("13 + 29 = 42", "42"),
        ("13 + 29 = 42.", "42"),
        ("42", "42"),
        ("The answer is 42.", "42"),
        ("Answer: 1,042 (that is 13 + 1029)", "1042"),
        ("-7", "-7"),
        ("I don't know", None),
    ],
)
def test_final_answer(text, want):
    assert final_answer(text) == want


def test_addition_in_chat_form(chat_model):
    task = AdditionTask(max_operand=50, system="Reply with the sum only.")
    task.bind_model(chat_model)
    p = task.sample(random.Random(0))
    a, b = p.meta["operands"]
    assert p.text == (
        "<|im_start|>system\nReply with the sum only.<|im_end|>\n"
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert task.reward(p, f"{a} + {b} = {a + b}.")["reward"] == 1.0
    assert task.reward(p, f"{a} + {b} = {a + b + 1}.")["reward"] == 0.0
    strict = task.reward(p, f"{a + b}")
    assert strict["reward"] == 1.0 and strict["format"] == 1.0
    assert task.reward(p, f"{a} + {b} = {a + b}")["format"] == 0.0


def test_the_tiny_model_keeps_the_plain_form(tiny_model):
    task = AdditionTask(max_operand=19)
    task.bind_model(tiny_model)  # chat: null and no template -> plain
    p = task.sample(random.Random(0))
    assert p.text.endswith("=") and "+" in p.text
    assert task.reward(p, p.answer)["reward"] == 1.0
    assert task.reward(p, f"x{p.answer}")["reward"] == 0.0  # plain form stays strict


def test_chat_true_needs_a_template(tiny_model):
    with pytest.raises(ValueError, match="task.chat=true but .* has no chat template"):
        AdditionTask(chat=True).bind_model(tiny_model)


def test_chat_false_keeps_plain_text_on_a_chat_model(chat_model):
    task = AdditionTask(chat=False)
    task.bind_model(chat_model)
    assert task.sample(random.Random(0)).text.endswith("=")


def test_jsonl_in_chat_form(chat_model, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    task = JsonlTask(str(data))
    task.bind_model(chat_model)
    p = task.sample(random.Random(0))
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>" in p.text
    assert task.reward(p, "2 + 2 = 4")["reward"] == 1.0


def test_the_tiny_models_cache_key_does_not_move():
    """The chat settings live outside the task's scalar attributes: the shipped tiny
    model's cache key (asyncrl/models/shipped.py) stays."""
    from asyncrl.models import shipped
    from asyncrl.models.tiny import cache_key, default_spec

    assert cache_key(AdditionTask(max_operand=19), default_spec()) == shipped.CACHE_KEY


def test_model_smollm2_composes_a_chat_run():
    from hydra import compose, initialize_config_dir

    from asyncrl.confdir import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=["model=smollm2"])
    assert cfg.model.preset == "smollm2" and cfg.model.path is None
    assert cfg.task.chat is True and cfg.task.system
    assert cfg.actor.engine.dtype == "float32"
    assert cfg.learner.optim.lr <= 1e-4  # a pretrained model: not the tiny model's 5e-4


def test_preset_and_path_together_are_refused(tiny_model):
    from hydra import compose, initialize_config_dir

    from asyncrl.confdir import conf_dir
    from asyncrl.wiring import prepare

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=["model=smollm2", f"model.path={tiny_model}"])
    with pytest.raises(ConfigError, match="model.preset=smollm2 and model.path=.*set one"):
        prepare(cfg)


def test_a_directory_without_a_template_is_known_without_transformers(tiny_model, chat_model):
    """``without_template`` (the driver's shortcut past importing transformers) says
    "none" only where transformers finds none: the tiny model; a template in a
    ``chat_template.jinja`` or in ``tokenizer_config.json`` is left to transformers."""
    from transformers import AutoTokenizer

    from asyncrl.tasks.chat import without_template

    inline = chat_model.parent / "inline"
    shutil.copytree(tiny_model, inline)
    config = json.loads((inline / "tokenizer_config.json").read_text())
    (inline / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    for model, none in ((tiny_model, True), (chat_model, False), (inline, False)):
        assert without_template(model) is none, model
        assert (AutoTokenizer.from_pretrained(str(model)).chat_template is None) is none, model
