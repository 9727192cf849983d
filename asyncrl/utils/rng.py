"""A process's RNG states (torch, CUDA, numpy, Python) as named tensors: what a checkpoint
keeps per learner rank so that a resumed run draws what it would have. Stored as
safetensors, a format that holds data only (loading one runs no code).

    torch            uint8 [5056]   torch.get_rng_state()
    cuda.<i>         uint8 [n]      device i's state (only where CUDA is available)
    numpy.key        int64 [624]    np.random.get_state()'s MT19937 key
    numpy.scalars    float64 [3]    its pos, has_gauss, cached_gaussian
    python.state     int64 [625]    random.getstate()'s MT state
    python.gauss     float64 [2]    has gauss_next, gauss_next
    python.version   int64 [1]      random.getstate()'s version
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

NUMPY_ALGORITHM = "MT19937"


def rng_tensors() -> dict[str, torch.Tensor]:
    alg, key, pos, has_gauss, cached = np.random.get_state()
    if alg != NUMPY_ALGORITHM:
        raise ValueError(f"numpy's global RNG is {alg}, expected {NUMPY_ALGORITHM}")
    version, state, gauss = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy.key": torch.from_numpy(key.astype(np.int64)),
        "numpy.scalars": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
        "python.state": torch.tensor(state, dtype=torch.int64),
        "python.gauss": torch.tensor(
            [gauss is not None, 0.0 if gauss is None else gauss], dtype=torch.float64
        ),
        "python.version": torch.tensor([version], dtype=torch.int64),
    }
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = s
    return out


def set_rng_tensors(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    pos, has_gauss, cached = t["numpy.scalars"].tolist()
    key = t["numpy.key"].numpy().astype(np.uint32)
    np.random.set_state((NUMPY_ALGORITHM, key, int(pos), int(has_gauss), cached))
    has, gauss = t["python.gauss"].tolist()
    state = tuple(int(x) for x in t["python.state"].tolist())
    random.setstate((int(t["python.version"][0]), state, gauss if has else None))
    cuda = sorted((k for k in t if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t[k] for k in cuda])


def save_rng(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in rng_tensors().items()}, str(path))


def load_rng(path: Path) -> None:
    """Restore this process's RNGs from ``path``; a file that is not safetensors raises
    (safetensors' own error), nothing in it runs."""
    from safetensors.torch import load_file

    set_rng_tensors(load_file(str(path)))
