"""A task from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line,
scored by exact match of the stripped completion against the answer.

With a chat model (``task.chat``, :mod:`asyncrl.tasks.chat`) each prompt is the user
message of the model's chat template, and a numeric answer also matches the
completion's final number ("13 + 29 = 42" matches "42")."""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.tasks.base import Prompt
from asyncrl.tasks.chat import ChatForm, final_answer

# Longest prompt accepted by default: prompts are generated from and trained on whole, and
# the tiny model's warm start attends over each in full (an 8 MB line hung start-up).
MAX_PROMPT_CHARS = 16384


class JsonlTask:
    def __init__(
        self, path: str, alphabet: str = "", chat: bool | None = None, system: str = "",
        max_prompt_chars: int = MAX_PROMPT_CHARS,
    ):  # fmt: skip
        self.chat_form = ChatForm(chat, system)
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"task.path={path}: no such file")
        self.items: list[Prompt] = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.items.append(
                    Prompt(text=str(row["prompt"]), answer=str(row.get("answer", "")))
                )
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"task.path={path} line {i}: expected a JSON object with a 'prompt' key ({e})"
                ) from e
            if len(self.items[-1].text) > max_prompt_chars:
                raise ValueError(
                    f"task.path={path} line {i}: the prompt is {len(self.items[-1].text)} "
                    f"characters, more than task.max_prompt_chars={max_prompt_chars} (shorten "
                    f"it, or raise the limit: +task.max_prompt_chars=N)"
                )
        if not self.items:
            raise ValueError(f"task.path={path} holds no prompts")
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
