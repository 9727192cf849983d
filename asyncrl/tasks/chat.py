"""Chat-form tasks for pretrained chat models: prompts go through the model's own chat
template, answers are read the way a chat model writes them.

A task is built before the model is resolved (the driver checks the task first), so it
learns the model's template from its ``bind_model(path)``, which the model resolution (:mod:`asyncrl.models.resolve`) calls in the driver, before the task
is sent to the actors. The template is rendered once there with a placeholder user
message and kept as a (prefix, suffix) pair of strings: the actors need no tokenizer,
and a prompt is the same string in every process.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# A chat model's last number is its answer: "13 + 29 = 42" -> 42, "The answer is 42." -> 42.
# "Answer: N" (the format the system prompt asks for) wins over any later number.
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*(-?\d[\d,]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*")
_PLACEHOLDER = "\x00asyncrl-user\x00"


def final_answer(text: str) -> str | None:
    """The integer a chat-style answer ends on, as a string without separators, or None."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


@dataclass(frozen=True)
class ChatFrame:
    """A chat template rendered around one user message (with the generation prompt)."""

    prefix: str
    suffix: str

    def render(self, user: str) -> str:
        return self.prefix + user + self.suffix

    @classmethod
    def from_model(
        cls, model_path: str | Path, system: str, examples: tuple[tuple[str, str], ...] = ()
    ) -> ChatFrame | None:
        """The frame of ``model_path``'s tokenizer, None when it has no chat template.
        ``examples``: (user, assistant) turns rendered before the user message, in the
        prefix. Raises ValueError when the template does not keep the user text verbatim."""
        if without_template(Path(model_path)):
            return None
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_path))
        if not getattr(tok, "chat_template", None):
            return None

        def text(user: str) -> str:
            messages = [{"role": "system", "content": system}] if system else []
            for question, answer in examples:
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": user})
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        whole = text(_PLACEHOLDER)
        if whole.count(_PLACEHOLDER) != 1:
            raise ValueError(f"{model_path}: the chat template does not keep the user message")
        prefix, suffix = whole.split(_PLACEHOLDER)
        frame = cls(prefix, suffix)
        if frame.render("1 + 2") != text("1 + 2"):  # a template that rewrites the content
            raise ValueError(f"{model_path}: the chat template rewrites the user message")
        return frame


# where transformers finds a tokenizer's chat template in a model directory
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def without_template(model_dir: Path) -> bool:
    """True when a local model directory certainly has no chat template (its
    ``tokenizer_config.json`` names none, and none of :data:`TEMPLATE_FILES` is there),
    so that the driver need not import transformers to find out; False when unsure."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file() or any((model_dir / f).exists() for f in TEMPLATE_FILES):
        return False
    try:
        return "chat_template" not in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


class ChatForm:
    """A task's chat settings (``task.chat``, ``task.system``) and, once bound, the
    model's frame. Kept as one attribute of the task so that the tiny model's cache key
    (the task's scalar attributes) does not change with them.

    ``chat``: None uses the model's chat template when it has one; True requires one;
    False sends the task's plain prompt. ``examples``: worked (question, answer) turns
    before every question (``task.shots``); they need a chat template."""

    def __init__(
        self, chat: bool | None = None, system: str = "",
        examples: tuple[tuple[str, str], ...] = (),
    ):  # fmt: skip
        if chat not in (None, True, False):
            raise ValueError(f"task.chat must be true, false or null, got {chat!r}")
        self.chat = chat
        self.system = system
        self.examples = tuple(examples)
        self.frame: ChatFrame | None = None

    def bind(self, model_path: str | Path) -> None:
        if self.chat is False and not self.examples:
            return
        try:
            self.frame = None if self.chat is False else ChatFrame.from_model(
                model_path, self.system, self.examples
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"task.chat: {e}") from e
        if self.frame is None and self.examples:
            raise ValueError(
                f"task.shots={len(self.examples)}: worked examples are chat turns, but "
                f"{model_path} has no chat template (or task.chat=false)"
            )
        if self.frame is None and self.chat:
            raise ValueError(f"task.chat=true but {model_path} has no chat template")

    @property
    def on(self) -> bool:
        return self.frame is not None

    def render(self, user: str) -> str:
        assert self.frame is not None, "bind() first"
        return self.frame.render(user)
