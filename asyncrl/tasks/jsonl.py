"""A task from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line,
scored by exact match of the stripped completion against the answer."""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.tasks.base import Prompt


class JsonlTask:
    def __init__(self, path: str, alphabet: str = ""):
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
        if not self.items:
            raise ValueError(f"task.path={path} holds no prompts")
        self.alphabet = alphabet or "".join(
            sorted({c for it in self.items for c in it.text + it.answer})
        )

    def sample(self, rng: random.Random) -> Prompt:
        return rng.choice(self.items)

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        return {"reward": float(completion.strip() == prompt.answer)}
