"""A task from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line,
scored by exact match of the stripped completion against the answer.

With a chat model (``task.chat``, :mod:`asyncrl.tasks.chat`) each prompt is the user
message of the model's chat template, and a numeric answer also matches the
completion's final number ("13 + 29 = 42" matches "42")."""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.tasks.base import Prompt
from asyncrl.tasks.chat import ChatForm, final_answer

# Longest prompt accepted by default: prompts are generated from and trained on whole, and
# the tiny model's warm start attends over each in full (an 8 MB line hung start-up).
MAX_PROMPT_CHARS = 16384
JSON_SPACE = " \t\r\n"  # JSON's whitespace: a line of only these is skipped


class JsonlTask:
    def __init__(
        self, path: str, alphabet: str = "", chat: bool | None = None, system: str = "",
        max_prompt_chars: int = MAX_PROMPT_CHARS,
    ):  # fmt: skip
        self.chat_form = ChatForm(chat, system)
        self.items = read_prompts(path, max_prompt_chars)
        self.alphabet = alphabet or "".join(
            sorted({c for it in self.items for c in it.text + it.answer})
        )

    def bind_model(self, model_path: str | Path) -> None:
        """The driver, once the model is resolved: chat form if the model has a template."""
        self.chat_form.bind(model_path)

    def sample(self, rng: random.Random) -> Prompt:
        item = rng.choice(self.items)
        if not self.chat_form.on:
            return item
        return Prompt(self.chat_form.render(item.text), item.answer, dict(item.meta))

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        got = completion.strip()
        if self.chat_form.on and prompt.answer.lstrip("-").isdigit():
            got = final_answer(completion) or got
        return {"reward": float(got == prompt.answer)}


def read_prompts(path: str, max_prompt_chars: int = MAX_PROMPT_CHARS) -> list[Prompt]:
    """The prompts of a JSONL file, read line by line (lines end at ``\\n`` only: a
    U+2028 inside a JSON string is text, as JSON says). Any bad line is a ConfigError
    naming ``task.path`` and the line's number: not UTF-8, not a JSON object with a
    ``prompt``, an empty or null prompt, a prompt over ``max_prompt_chars``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"task.path={path}: no such file")
    items: list[Prompt] = []
    try:
        with p.open("rb") as f:
            for i, raw in enumerate(f, 1):
                item = _prompt_of(raw, f"task.path={path} line {i}", i == 1, max_prompt_chars)
                if item is not None:
                    items.append(item)
    except OSError as e:
        raise ConfigError(f"task.path={path}: cannot be read ({e.strerror or e})") from None
    if not items:
        raise ConfigError(f"task.path={path} holds no prompts")
    return items


def _prompt_of(raw: bytes, where: str, first: bool, max_prompt_chars: int) -> Prompt | None:
    """One line's Prompt, None for a blank line, or a ConfigError starting ``where``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)"
        ) from None
    if first:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip(JSON_SPACE):
        return None
    try:
        row = json.loads(line.removesuffix("\n").removesuffix("\r"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: not JSON (nested too deeply)") from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise ConfigError(f"{where}: expected a JSON object with a 'prompt' key")
    prompt, answer = row["prompt"], row.get("answer")
    if not _scalar(prompt) or not str(prompt).strip():
        raise ConfigError(f"{where}: 'prompt' is {_shown(prompt)}: expected a non-empty string")
    if answer is not None and not _scalar(answer):
        raise ConfigError(f"{where}: 'answer' is {_shown(answer)}: expected a string or number")
    text = str(prompt)
    if len(text) > max_prompt_chars:
        raise ConfigError(
            f"{where}: the prompt is {len(text)} characters, more than "
            f"task.max_prompt_chars={max_prompt_chars} (shorten it, or raise the limit: "
            f"+task.max_prompt_chars=N)"
        )
    return Prompt(text=text, answer="" if answer is None else str(answer))


def _scalar(v: object) -> bool:
    return isinstance(v, str | int | float) and not isinstance(v, bool)


def _shown(v: object) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
