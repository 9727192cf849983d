"""``env=visual_addition_mt``: task=visual_addition over turns, with images in the
observations (docs/vision.md, Images in an episode's observations).

    prompt   <image>                 the task's image of "13+7=" (19 tokens, not trained)
    turn 1   21<eos>                 (generated, trained: a wrong sum)
    observe  <image>                 the same sum drawn afresh: another font size,
                                     place, ink, paper and noise (19 tokens, not trained)
    turn 2   20<eos>                 (generated: right; the episode ends)

A right answer ends the episode; a wrong one is shown a fresh drawing, up to
``env.retries`` times. Reward: the exact sum of the last answer, times
``env.retry_credit`` per retry it took. The fresh drawings of an episode depend only on
the prompt's image and the retry's number, so the samples of one group that answer
wrong see the same images.
"""

from __future__ import annotations

import hashlib
import random

from asyncrl.config import settings_from
from asyncrl.envs.base import StepResult
from asyncrl.envs.settings import VisualRetrySettings
from asyncrl.tasks.base import Prompt, Task
from asyncrl.tasks.visual import IMAGE_PLACEHOLDER, VisualAdditionTask, png_bytes


class VisualRetryEnv:
    """One episode of ``env=visual_addition_mt`` (see the module doc)."""

    def __init__(self, retries: int, retry_credit: float):
        given = {"retries": retries, "retry_credit": retry_credit}
        self.settings: VisualRetrySettings = settings_from(VisualRetrySettings, given, "env")
        self.sample: Prompt | None = None
        self.task: VisualAdditionTask | None = None
        self.retries = 0

    @staticmethod
    def check_task(task: Task) -> None:
        """The env redraws the task's sums: task=visual_addition only (ValueError)."""
        if not isinstance(task, VisualAdditionTask):
            raise ValueError(
                f"draws task=visual_addition's sums again, not {type(task).__name__}'s: "
                "set task=visual_addition"
            )

    async def reset(self, sample: Prompt, task: Task) -> None:
        self.check_task(task)
        self.sample, self.task, self.retries = sample, task, 0

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        out = self.task.reward(self.sample, text)
        info = {k: float(v) for k, v in out.items() if k != "reward"}
        info["retries"] = float(self.retries)
        if out["exact"] or self.retries >= self.settings.retries:
            reward = float(out["reward"]) * self.settings.retry_credit**self.retries
            return StepResult(reward=reward, done=True, info=info)
        self.retries += 1
        return StepResult(observation=IMAGE_PLACEHOLDER, images=[self.redraw()], info=info)

    def redraw(self) -> bytes:
        """The prompt's sum drawn afresh (PNG), seeded by its image and the retry."""
        t, first = self.task, self.sample.meta["images"][0]
        key = hashlib.blake2b(first + self.retries.to_bytes(2, "big"), digest_size=8)
        rng = random.Random(int.from_bytes(key.digest(), "big"))
        return png_bytes(t.draw(self.sample.meta["shown"], rng)[0])
