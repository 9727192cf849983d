"""A long-answer task: multi-digit addition worked column by column, then the sum.

Prompt ``"0473+2958="`` (every operand zero-padded to ``num_digits``), target

    ``"3+8+0=11;7+5+1=13;4+9+1=14;0+2+1=03;03431"``

one column per ``;``-terminated step, from the ones upwards: ``a+b+carry=ss`` with the
column's sum always two digits, then the sum itself in ``num_digits + 1`` digits. Every
field sits at a fixed position (zero padding, two-digit sums), so a small character-level
model can learn where to look; the working makes the answer long (9 characters a column:
``num_digits=7`` is 72 characters and EOS, ~73 tokens with the character tokenizer) and
each step depends on the one before through the carry, which is what makes it worth
writing out.

Rewarded on the final answer (the field after the last ``;``): 1 if it is the sum,
plus ``partial_credit`` x the share of its digits in the right place; ``format`` (logged)
says whether the whole completion has the working's exact shape.

``digits_tail`` > 0 makes answer lengths heavy-tailed: each prompt draws its width ``d``
from 1..``num_digits`` with probability proportional to ``d ** -digits_tail`` (2.0 with
``num_digits=10``: 65% of prompts have one digit, a 12-token answer; 0.6% have ten, 102
tokens), so a few answers are ~10x longer than most.
"""

from __future__ import annotations

import functools
import math
import random
import re
from typing import ClassVar

from asyncrl.tasks.base import Prompt, digit_credit

ALPHABET = "0123456789+=;"
COLUMN_CHARS = 9  # "a+b+c=ss;"


def working(a: int, b: int, num_digits: int) -> str:
    """The target completion for ``a + b`` (both < 10**num_digits): the columns, then the sum."""
    steps, carry = [], 0
    for i in range(num_digits):
        da, db = a // 10**i % 10, b // 10**i % 10
        s = da + db + carry
        steps.append(f"{da}+{db}+{carry}={s:02d};")
        carry = s // 10
    return "".join(steps) + f"{a + b:0{num_digits + 1}d}"


@functools.cache
def working_shape(num_digits: int) -> re.Pattern:
    """The exact shape of a ``num_digits``-wide working: its columns, then the sum."""
    col = r"\d\+\d\+[01]=\d\d;"
    return re.compile(rf"(?:{col}){{{num_digits}}}\d{{{num_digits + 1}}}")


def final_field(completion: str) -> str:
    """The answer a completion ends on: the text after its last ``;`` (all of it if none)."""
    return completion.strip().rsplit(";", 1)[-1]


class ColumnAdditionTask:
    # settings whose default leaves the tiny model's cache key as it was (models/tiny.py)
    LATER_FIELDS: ClassVar[dict[str, float]] = {"digits_tail": 0.0}

    def __init__(self, num_digits: int = 7, partial_credit: float = 0.0, digits_tail: float = 0.0):
        if num_digits < 1:
            raise ValueError(f"task.num_digits must be >= 1, got {num_digits}")
        if partial_credit < 0:
            raise ValueError(f"task.partial_credit must be >= 0, got {partial_credit}")
        if not (math.isfinite(digits_tail) and digits_tail >= 0):
            raise ValueError(f"task.digits_tail must be a finite number >= 0, got {digits_tail}")
        self.num_digits = num_digits
        self.partial_credit = partial_credit
        self.digits_tail = digits_tail
        self._widths = list(range(1, num_digits + 1))
        self._weights = [d**-digits_tail for d in self._widths]

    @property
    def alphabet(self) -> str:
        return ALPHABET

    @property
    def max_response_chars(self) -> int:
        return COLUMN_CHARS * self.num_digits + self.num_digits + 1

    def bind_model(self, model_path: object) -> None:
        """No chat form: the character-level model reads the plain prompt."""

    def sample(self, rng: random.Random) -> Prompt:
        d = rng.choices(self._widths, self._weights)[0] if self.digits_tail > 0 else self.num_digits
        top = 10**d - 1
        a, b = rng.randint(0, top), rng.randint(0, top)
        return Prompt(
            text=f"{a:0{d}d}+{b:0{d}d}=",
            answer=working(a, b, d),
            meta={"operands": [a, b], "sum": a + b},
        )

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        d = prompt.text.index("+")  # the prompt's width: its first operand's digits
        shaped = working_shape(d).fullmatch(completion.strip()) is not None
        credit = digit_credit(
            final_field(completion), final_field(prompt.answer), self.partial_credit
        )
        return {**credit, "format": float(shaped)}
