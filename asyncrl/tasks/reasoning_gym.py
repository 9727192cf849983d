"""Any reasoning-gym dataset as a task: ``task=reasoning_gym task.dataset=<name>``.

reasoning-gym (``pip install 'asyncrl[reasoning_gym]'``) generates each dataset
procedurally from its config, seed and size: entry ``i`` is a fixed function of them,
so every actor, the evaluator and a resumed run see the same problems with no download.

    sample(rng):  i ~ uniform(0, size) ─▶ entry i {question, answer, metadata}
                  ─▶ Prompt(question, through the model's chat template when it has one)
    reward:       the completion's answer (the last <answer>...</answer>, else its last
                  non-empty line) ─▶ the dataset's own score_answer(answer, entry)

The held-out split is the usual one (asyncrl/eval/split.py): a hash of the prompt's
text, so a problem is on one side only, whatever index or seed drew it.

``shots`` worked examples (a chat model's few-shot prompt) are the dataset's last
``shots`` entries, each a user turn (its question) and an assistant turn (its answer,
bare) before every question; a problem whose question is one of theirs is never drawn,
so no prompt carries its own answer.

The answer is read the way reasoning-gym's own system prompts ask a chat model to
write it: inside ``<answer>`` tags (the last pair wins; ``reward/tagged`` is 1 when the
completion has one). A completion without tags is read by its last non-empty line, which
is how a model without a chat template (the tiny model, warm-started on bare answers)
answers.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.tasks.base import Prompt
from asyncrl.tasks.chat import ChatForm

INSTALL = "pip install 'asyncrl[reasoning_gym]' (or: pip install reasoning-gym)"
DEFAULT_SYSTEM = "default"  # reasoning-gym's SYSTEM_PROMPTS key: asks for <answer> tags
MAX_REDRAWS = 10_000  # draws that may hit a worked example's question before giving up
_TAGGED = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def answer_of(completion: str) -> tuple[str, bool]:
    """(the answer a completion gives, whether it was tagged): the last
    ``<answer>...</answer>`` (stripped), else the last non-empty line (stripped)."""
    tagged = _TAGGED.findall(completion)
    if tagged:
        return tagged[-1].strip(), True
    lines = [ln.strip() for ln in completion.splitlines() if ln.strip()]
    return (lines[-1] if lines else ""), False


def answer_text(entry: dict[str, Any]) -> str:
    """An entry's reference answer as text ("" when it has none)."""
    return "" if entry.get("answer") is None else str(entry["answer"])


class ReasoningGymTask:
    """``dataset``: a reasoning-gym dataset name; ``config``: its config's fields (its
    ``seed`` and ``size`` are this task's ``seed`` and ``size``); ``system``: the system
    message in chat form (None: reasoning-gym's ``default`` system prompt, "" : the
    chat template's own); ``shots``: worked examples before each question (chat form)."""

    def __init__(
        self, dataset: str, config: dict[str, Any] | None = None, size: int = 1000,
        seed: int = 0, chat: bool | None = None, system: str | None = None, shots: int = 0,
    ):  # fmt: skip
        rg = _import()
        config = dict(config or {})
        for key in ("seed", "size"):
            if key in config:
                raise ConfigError(f"task.config.{key}: set task.{key} instead")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"task.size={size!r}: expected an integer >= 1")
        if isinstance(shots, bool) or not isinstance(shots, int) or not 0 <= shots < size:
            raise ConfigError(f"task.shots={shots!r}: expected an integer in [0, task.size)")
        self.dataset_name = dataset
        self.size = size
        self.seed = seed
        self.config_key = json.dumps(config, sort_keys=True)  # a scalar: the tiny model's key
        self.data = _create(rg, dataset, config, seed, size)
        if system is None:
            system = rg.utils.SYSTEM_PROMPTS[DEFAULT_SYSTEM]
        self._entries: dict[int, dict[str, Any]] = {}
        shown = [self.entry(i) for i in range(size - shots, size)]
        examples = tuple((e["question"], answer_text(e)) for e in shown)
        self._shown = frozenset(q for q, _ in examples)  # never drawn as a problem
        self.chat_form = ChatForm(chat, system, examples)

    def bind_model(self, model_path: str | Path) -> None:
        """The driver, once the model is resolved: chat form if the model has a template."""
        self.chat_form.bind(model_path)

    def entry(self, index: int) -> dict[str, Any]:
        """Entry ``index`` of the dataset (generated once, then kept)."""
        if index not in self._entries:
            self._entries[index] = self.data[index]
        return self._entries[index]

    def sample(self, rng: random.Random) -> Prompt:
        for _ in range(MAX_REDRAWS):
            index = rng.randrange(self.size)
            e = self.entry(index)
            if e["question"] not in self._shown:
                break
        else:
            raise ConfigError(
                f"task.shots={len(self._shown)}: {MAX_REDRAWS} draws in a row found only the "
                f"worked examples' questions; {self.dataset_name} has too few distinct problems"
            )
        text = self.chat_form.render(e["question"]) if self.chat_form.on else e["question"]
        answer = answer_text(e)
        meta = {"task": f"reasoning_gym/{self.dataset_name}", "index": index}
        return Prompt(text, answer, meta)

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        answer, tagged = answer_of(completion)
        score = self.data.score_answer(answer, self.entry(int(prompt.meta["index"])))
        return {"reward": float(score), "tagged": float(tagged)}

    @property
    def alphabet(self) -> str:
        """Every character of every question and answer (the tiny model's vocabulary)."""
        chars: set[str] = set()
        for i in range(self.size):
            e = self.entry(i)
            chars.update(e["question"] + str(e.get("answer") or ""))
        return "".join(sorted(chars))


def _import() -> Any:
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401  (its SYSTEM_PROMPTS)
    except ImportError:
        raise ConfigError(
            f"task=reasoning_gym needs the reasoning-gym package: {INSTALL}"
        ) from None
    return reasoning_gym


def _create(rg: Any, name: str, config: dict[str, Any], seed: int, size: int) -> Any:
    """The dataset, or a ConfigError naming the key: an unknown ``task.dataset`` (with the
    closest and a few other valid names), a field its config lacks, a value it refuses."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        names = sorted(DATASETS)
        near = difflib.get_close_matches(str(name), names, n=3) or names[:5]
        raise ConfigError(
            f"task.dataset={name!r} is not a reasoning-gym dataset; e.g. {', '.join(near)} "
            f"({len(names)} in all: python -c 'import reasoning_gym.factory as f; "
            f"print(sorted(f.DATASETS))')"
        )
    fields = set(DATASETS[name][1].__dataclass_fields__)
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ConfigError(
            f"task.config: {name} takes no {unknown}; its fields are {sorted(fields - {'seed', 'size'})}"
        )
    try:
        return rg.create_dataset(name, **config, seed=seed, size=size)
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(
            f"task.config: {name} refuses {config}: {e or type(e).__name__}"
        ) from None
