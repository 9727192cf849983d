"""``task=reasoning_gym``: any reasoning-gym dataset by name and config, built from the
shipped preset, scored by the dataset's own ``score_answer``, with a held-out split."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from asyncrl.config import ConfigError, build  # noqa: E402
from asyncrl.eval.split import TrainSplit, heldout_prompts  # noqa: E402
from asyncrl.tasks.base import score  # noqa: E402
from asyncrl.tasks.reasoning_gym import ReasoningGymTask, answer_of  # noqa: E402

CONF = Path(__file__).parents[1] / "conf"


def preset(**overrides):
    """The task as ``task=reasoning_gym`` (plus overrides) builds it."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(CONF / "task" / "reasoning_gym.yaml")
    return build("task", OmegaConf.merge(node, overrides))


@pytest.fixture(scope="module")
def rg_task():
    return preset(
        dataset="basic_arithmetic", config={"max_terms": 3, "max_digits": 2}, size=200, seed=3
    )


def test_builds_from_config_and_draws_the_datasets_problems(rg_task):
    task = rg_task
    import reasoning_gym

    assert isinstance(task, ReasoningGymTask)
    assert task.data.config.max_terms == 3 and task.size == 200
    own = reasoning_gym.create_dataset(
        "basic_arithmetic", max_terms=3, max_digits=2, seed=3, size=200
    )
    p = task.sample(random.Random(0))
    e = own[p.meta["index"]]
    assert p.text == e["question"] and p.answer == e["answer"]  # no chat template here
    assert p.meta["task"] == "reasoning_gym/basic_arithmetic"
    texts = {task.sample(random.Random(i)).text for i in range(20)}
    assert len(texts) > 10  # many problems, not one


def test_a_right_answer_scores_1_and_a_wrong_one_0(rg_task):
    task = rg_task
    p = task.sample(random.Random(1))
    right = f"Adding up step by step.\n<answer>{p.answer}</answer>"
    assert score(task, p, right) == (1.0, {"tagged": 1.0}, "")
    assert score(task, p, "<answer>x</answer>")[0] == 0.0
    # the last tagged answer counts; untagged, the last non-empty line
    assert score(task, p, f"<answer>{p.answer}</answer> no, <answer>x</answer>")[0] == 0.0
    assert score(task, p, f"so\n{p.answer}\n\n") == (1.0, {"tagged": 0.0}, "")
    assert answer_of("a\n b \n") == ("b", False)


def test_the_datasets_own_scorer_decides():
    """A dataset with a scorer of its own (not exact match): word_sorting takes the
    words in order whatever the separators; a wrong order scores less than 1."""
    t = preset(dataset="word_sorting", size=50)
    p = t.sample(random.Random(0))
    words = [w.strip() for w in p.answer.split(",")]
    assert score(t, p, f"<answer>{', '.join(words)}</answer>")[0] == 1.0
    assert score(t, p, f"<answer>{', '.join(reversed(words))}</answer>")[0] < 1.0


def test_the_heldout_split_is_disjoint_from_training(rg_task):
    task = rg_task
    held = heldout_prompts(task, 0.2, seed=1, n=30)
    train = TrainSplit(task, 0.2)
    rng = random.Random(0)
    trained = {train.sample(rng).text for _ in range(400)}
    assert len(held) >= 10
    assert not trained & {p.text for p in held}
    # the same held-out set in every process and run: a property of the problems
    assert [p.text for p in heldout_prompts(task, 0.2, seed=1, n=30)] == [p.text for p in held]


def test_an_unknown_dataset_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as e:
        ReasoningGymTask("chain_summ")
    msg = str(e.value)
    assert "task.dataset='chain_summ'" in msg and "chain_sum" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="task.config: chain_sum takes no"):
        ReasoningGymTask("chain_sum", config={"max_term": 3})
    with pytest.raises(ConfigError, match="task.config.seed: set task.seed"):
        ReasoningGymTask("chain_sum", config={"seed": 3})
    with pytest.raises(ConfigError, match="task.dataset='nope'"):
        preset(dataset="nope")  # through the config builder too


def test_without_reasoning_gym_one_line_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if absent
    with pytest.raises(ConfigError) as e:
        ReasoningGymTask("chain_sum")
    assert "pip install" in str(e.value) and "\n" not in str(e.value)


def test_worked_examples_come_before_every_question_and_are_never_drawn(chat_model):
    """``task.shots``: the dataset's last entries, each a user turn and the bare answer,
    rendered by the template before the question; their questions are never drawn
    (products of 1-digit numbers repeat within 60 entries)."""
    t = preset(dataset="products", config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
               "max_digits": 1}, size=60, shots=2, system="Reply with the answer only.")  # fmt: skip
    t.bind_model(chat_model)
    shown = [t.entry(58), t.entry(59)]
    turns = "".join(
        f"<|im_start|>user\n{e['question']}<|im_end|>\n<|im_start|>assistant\n{e['answer']}"
        "<|im_end|>\n"
        for e in shown
    )
    p = t.sample(random.Random(0))
    assert p.text == (
        "<|im_start|>system\nReply with the answer only.<|im_end|>\n" + turns
        + f"<|im_start|>user\n{t.entry(p.meta['index'])['question']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # fmt: skip
    questions = {e["question"] for e in shown}
    repeats = [i for i in range(58) if t.entry(i)["question"] in questions]
    assert repeats  # the check below has teeth: the examples' problems recur in the data
    drawn = [t.sample(random.Random(s)).meta["index"] for s in range(300)]
    assert not set(drawn) & {*repeats, 58, 59}
    assert score(t, p, str(p.answer))[0] == 1.0  # answered bare, as the examples are


def test_worked_examples_need_a_chat_template_and_a_count_in_range(tiny_model):
    t = preset(dataset="chain_sum", size=50, shots=1)
    with pytest.raises(ValueError, match="task.shots=1: worked examples are chat turns"):
        t.bind_model(tiny_model)  # no chat template
    for bad in (-1, 50, True, 1.5):
        with pytest.raises(ConfigError, match=f"task.shots={bad!r}: expected an integer"):
            ReasoningGymTask("chain_sum", size=50, shots=bad)
    assert preset(dataset="chain_sum", size=50).chat_form.examples == ()  # the default: none
