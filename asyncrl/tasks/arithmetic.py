"""The default task: small-operand addition, scored by an exact verifier.

Prompt ``"37+58="``, target ``"95"``. The alphabet is tiny (digits, ``+``, ``=``), so a
character-level tokenizer and a sub-million-parameter model learn it on a CPU.
"""

from __future__ import annotations

import random

from asyncrl.tasks.base import Prompt

ALPHABET = "0123456789+="


class AdditionTask:
    def __init__(self, max_operand: int = 99, num_operands: int = 2, partial_credit: float = 0.0):
        if max_operand < 1:
            raise ValueError(
                f"task.max_operand must be >= 1 (there would be no prompts), got {max_operand}"
            )
        if num_operands < 2:
            raise ValueError(f"task.num_operands must be >= 2, got {num_operands}")
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.partial_credit = partial_credit

    @property
    def alphabet(self) -> str:
        return ALPHABET

    @property
    def max_response_chars(self) -> int:
        return len(str(self.max_operand * self.num_operands))

    def sample(self, rng: random.Random) -> Prompt:
        xs = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        return Prompt(text="+".join(map(str, xs)) + "=", answer=str(sum(xs)), meta={"operands": xs})

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        got, want = completion.strip(), prompt.answer
        exact = float(got == want)
        digits = sum(a == b for a, b in zip(got, want)) / max(len(want), len(got), 1)
        return {
            "reward": exact + self.partial_credit * digits,
            "exact": exact,
            "digits": digits,
            "format": float(got.isdigit()),
        }
