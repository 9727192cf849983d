"""A rank's RNG states go to safetensors and come back exactly: what is drawn after a
load equals what was drawn after the save (torch, numpy, Python, Python's cached gauss)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.utils.rng import load_rng, save_rng


def draws() -> list[float]:
    return [
        *torch.rand(3).tolist(),
        *np.random.rand(3).tolist(),
        np.random.standard_normal(),
        random.random(),
        random.gauss(0.0, 1.0),
    ]


@pytest.mark.parametrize("cached_gauss", [False, True])
def test_rng_states_round_trip(tmp_path, cached_gauss):
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    if cached_gauss:  # both keep a second normal for the next call: it must survive too
        random.gauss(0.0, 1.0)
        np.random.standard_normal()
    path = tmp_path / "rank0.safetensors"
    save_rng(path)
    want = draws()
    for _ in range(5):
        draws()
    load_rng(path)
    assert draws() == want


def test_a_file_that_is_not_safetensors_raises(tmp_path):
    path = tmp_path / "rank0.safetensors"
    path.write_bytes(b"\x80\x04K\x01.")  # a pickle of 1
    with pytest.raises(Exception, match="(?i)header|deserializ"):
        load_rng(path)
