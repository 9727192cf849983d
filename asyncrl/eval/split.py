"""The held-out split of a task: which prompts training never sees.

A prompt is held out when a hash of its problem (:func:`problem_key`: its text, and for
an image prompt, whose text is the placeholder alone, the problem drawn into the image)
falls below ``eval.heldout_frac``: a fixed
property of the problem itself, not of the order it was drawn in, so the split is the
same in every actor, every run and every resume. The addition task draws operands
uniformly from a finite space (asyncrl/tasks/arithmetic.py: 20 x 20 = 400 problems at
the default max_operand 19), so a different seed alone would re-draw problems the
policy trains on; with evaluation on, the training task is wrapped in
:class:`TrainSplit`, which redraws every held-out problem, and the evaluation sets are
drawn from the held-out problems only (:func:`heldout_prompts`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from asyncrl.tasks.base import Prompt, Task

# Draws a split may take to find a prompt of its side before it gives up: with the
# default 10% held out, a training draw needs 1.1 on average; a task whose prompts
# (almost) all fall on one side is a config error, not a loop.
MAX_DRAWS = 1000
# Draws in a row that find no new held-out prompt before :func:`heldout_prompts` takes
# the split as exhausted: the last unseen problem of a 400-problem space is missed with
# probability e^-12.5. Fixed, not scaled by the prompts asked for: asking for more than
# the split holds costs this tail once (about 10 s for ``task=visual_addition``).
EXHAUSTED_AFTER = 5000


def problem_key(prompt: Prompt) -> str:
    """What the split hashes: the prompt's text; for a prompt with images, whose text
    need not say the problem (``task=visual_addition``'s is ``<image>`` alone), the text
    and the problem the task drew (``meta["shown"]``), or else the images' bytes: each
    rendering of one problem is then a problem of its own."""
    images = prompt.meta.get("images")
    if not images:
        return prompt.text
    if "shown" in prompt.meta:
        return f"{prompt.text}\0{prompt.meta['shown']}"
    return f"{prompt.text}\0{hashlib.sha256(b''.join(images)).hexdigest()}"


def is_heldout(text: str, frac: float) -> bool:
    """Whether a prompt belongs to the held-out split, by its :func:`problem_key` (for a
    text prompt, its text)."""
    h = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < frac


class TrainSplit:
    """``task`` without its held-out prompts (drawn again, from the same rng). Forwards
    every other attribute (alphabet, bind_model, ...) to the task."""

    def __init__(self, task: Task, frac: float):
        self.inner = task
        self.frac = frac

    def sample(self, rng: random.Random) -> Prompt:
        for _ in range(MAX_DRAWS):
            p = self.inner.sample(rng)
            if not is_heldout(problem_key(p), self.frac):
                return p
        raise RuntimeError(
            f"{MAX_DRAWS} draws in a row were held out (eval.heldout_frac={self.frac})"
        )

    def reward(self, prompt: Prompt, completion: str) -> Any:
        return self.inner.reward(prompt, completion)

    def __getattr__(self, name: str) -> Any:
        # pickling looks attributes up before __init__ ran: no recursion through inner
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def heldout_prompts(task: Task, frac: float, seed: int, n: int) -> list[Prompt]:
    """Up to ``n`` distinct held-out prompts of ``task``, drawn with ``seed``. Fewer when
    the held-out split has fewer problems (the default addition task: about 40)."""
    rng = random.Random(seed)
    out: dict[str, Prompt] = {}
    misses = 0
    while len(out) < n and misses < EXHAUSTED_AFTER:
        p = task.sample(rng)
        key = problem_key(p)
        if is_heldout(key, frac) and key not in out:
            out[key] = p
            misses = 0
        else:
            misses += 1
    return list(out.values())
