"""Reward-hacking defences as components: strict answer extraction and DAPO's overlong
penalty. Cheap and pure; they run on the reward workers like any component.

* :class:`StrictAnswer`: 1 when the response holds exactly one final answer and it is
  the reference; a response with several candidate answers scores 0 (a policy must not
  win by listing guesses and having the first, or any, one taken). As a weight-0
  component it is the second verifier the hacking monitor compares the reward with.
* :class:`OverlongPenalty`: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13):
  0 up to ``max_tokens - buffer_tokens`` generated tokens, then linearly down to
  ``-factor`` at ``max_tokens``, ``-factor`` beyond.
"""

from __future__ import annotations

import re

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def strict_answer(response: str) -> str | None:
    """The response's only number, or None when it has none or several (including a
    number split by other text: "25 or 26", "25+1=26")."""
    found = NUMBER.findall(response)
    return found[0] if len(found) == 1 else None


class StrictAnswer(Reward):
    """``value`` 1.0 iff :func:`strict_answer` equals the reference answer. Sub-scores:
    ``several`` (1.0 when the response offered more than one number)."""

    name = "strict"

    def __init__(self, name: str = "strict", max_batch: int = 256):
        self.name, self.max_batch = name, max_batch

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        out = []
        for x in batch:
            got = strict_answer(x.response)
            several = len(NUMBER.findall(x.response)) > 1
            ok = got is not None and x.answer is not None and got == str(x.answer).strip()
            out.append(RewardOutput(float(ok), {"several": float(several)}))
        return out


class OverlongPenalty(Reward):
    """DAPO's soft overlong penalty on the number of generated tokens (the module
    docstring). ``max_tokens``: the length where the penalty reaches ``-factor``;
    ``buffer_tokens``: how many tokens before it the penalty starts."""

    name = "overlong"

    def __init__(
        self, max_tokens: int, buffer_tokens: int, factor: float = 1.0, name: str = "overlong"
    ):
        if max_tokens < 1 or not 0 <= buffer_tokens <= max_tokens or factor < 0:
            raise ValueError(
                f"need max_tokens >= 1, 0 <= buffer_tokens <= max_tokens, factor >= 0; got "
                f"max_tokens={max_tokens}, buffer_tokens={buffer_tokens}, factor={factor}"
            )
        self.max_tokens, self.buffer, self.factor, self.name = (
            max_tokens, buffer_tokens, factor, name,
        )  # fmt: skip

    def penalty(self, n: int) -> float:
        start = self.max_tokens - self.buffer
        if n <= start:
            return 0.0
        if n >= self.max_tokens or self.buffer == 0:
            return -self.factor
        return -self.factor * (n - start) / self.buffer

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        return [RewardOutput(self.penalty(len(x.response_ids))) for x in batch]


class LengthReward(Reward):
    """Deliberately hackable: pays ``per_token`` for every generated token. For tests
    and demonstrations of the hacking monitors (conf/reward/length_hack.yaml), never
    for training a model you want."""

    name = "length"

    def __init__(self, per_token: float = 1.0, name: str = "length"):
        self.per_token, self.name = per_token, name

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        return [RewardOutput(self.per_token * len(x.response_ids)) for x in batch]
