"""Helpers shared by several test modules (import as ``from helpers import ...``: pytest
puts ``tests/`` on ``sys.path``, the folder has no ``__init__.py``)."""

from __future__ import annotations

import numpy as np

from asyncrl.models.tiny import random_qwen2
from asyncrl.trajectory import Trajectory


def build_tiny_qwen(d, tie: bool = True):
    """A random Qwen2 (hidden 64, 2 layers, 2 heads, vocab 20) saved in HF format at ``d``
    (the learner tests share it)."""
    random_qwen2(20, 64, 2, 2, 1, 96, tie=tie, out_dir=d, pad_token_id=0)
    return d


def trajs(n: int, seed: int = 0, max_prompt: int = 6, max_response: int = 7) -> list[Trajectory]:
    """``n`` random trajectories over the tiny model's vocabulary, four to a group."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, max_prompt)), int(rng.integers(1, max_response))
        out.append(
            Trajectory(
                f"t{i}",
                f"g{i // 4}",
                rng.integers(1, 20, p),
                rng.integers(1, 20, r),
                -rng.random(r).astype(np.float32),
                np.zeros(r, np.int32),
                np.ones(r, bool),
                float(rng.random() < 0.5),
            )
        )
    return out
