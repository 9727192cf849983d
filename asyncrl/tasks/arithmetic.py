"""The default task: small-operand addition, scored by an exact verifier.

Plain form (the tiny model): prompt ``"37+58="``, target ``"95"``. The alphabet is tiny
(digits, ``+``, ``=``), so a character-level tokenizer and a sub-million-parameter model
learn it on a CPU.

Chat form (a model with a chat template, ``task.chat``; model=smollm2 turns it on): the
question ``"What is 37 + 58?"`` after ``task.system``, through the model's chat template
(:mod:`asyncrl.tasks.chat`), and the answer is the completion's final number, so a chat
model's "37 + 58 = 95." scores as 95.
"""

from __future__ import annotations

import random
from pathlib import Path

from asyncrl.tasks.base import Prompt, digit_credit
from asyncrl.tasks.chat import ChatForm, final_answer

ALPHABET = "0123456789+="


class AdditionTask:
    def __init__(
        self,
        max_operand: int = 99,
        num_operands: int = 2,
        partial_credit: float = 0.0,
        chat: bool | None = None,
        system: str = "",
    ):
        if max_operand < 1:
            raise ValueError(
                f"task.max_operand must be >= 1 (there would be no prompts), got {max_operand}"
            )
        if num_operands < 2:
            raise ValueError(f"task.num_operands must be >= 2, got {num_operands}")
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.partial_credit = partial_credit
        self.chat_form = ChatForm(chat, system)

    @property
    def alphabet(self) -> str:
        return ALPHABET

    @property
    def max_response_chars(self) -> int:
        return len(str(self.max_operand * self.num_operands))

    def bind_model(self, model_path: str | Path) -> None:
        """The driver, once the model is resolved: chat form if the model has a template."""
        self.chat_form.bind(model_path)

    def sample(self, rng: random.Random) -> Prompt:
        xs = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        if self.chat_form.on:
            text = self.chat_form.render(f"What is {' + '.join(map(str, xs))}?")
        else:
            text = "+".join(map(str, xs)) + "="
        return Prompt(text=text, answer=str(sum(xs)), meta={"operands": xs})

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        want = prompt.answer
        if self.chat_form.on:
            got = final_answer(completion) or ""
            strict = float(completion.strip().rstrip(".") == want)  # the number alone
        else:
            got = completion.strip()
            strict = float(got.isdigit())
        return {**digit_credit(got, want, self.partial_credit), "format": strict}
