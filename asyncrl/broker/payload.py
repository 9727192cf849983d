"""The object-store broker's weights payload: one ``ray.put`` of every tensor as a NumPy
view, so the weights are copied once into the object store and an actor's ``ray.get``
maps them without a copy.

    learner rank 0: parameter ─(view; GPU or an FSDP unshard: one copy to CPU)─▶ NumPy
                    ─ray.put (the one copy)─▶ object store
    actor:          ray.get ─▶ NumPy views of the store's memory ─▶ torch tensors (views)
                    = ``{name: tensor}``, what ``RolloutActor.update_weights`` loads

Ray pickles NumPy arrays out of band (pickle protocol 5) and hands them back as read-only
views of the stored buffer; torch tensors it would copy on both ends. bfloat16 has no
NumPy dtype, so such tensors travel as int16 and are viewed back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch

# torch dtypes without a NumPy twin travel as a same-width integer view
_VIEW_AS = {torch.bfloat16: torch.int16}


class PackedWeights:
    """``{name: tensor}`` that unpickles as exactly that dict (tensors sharing the
    unpickled buffers). ``nbytes``: the payload's size."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.arrays: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        for name, t in named:
            t = t.detach().contiguous()
            self.dtypes[name] = str(t.dtype).removeprefix("torch.")
            self.arrays[name] = t.view(_VIEW_AS.get(t.dtype, t.dtype)).numpy()
        self.nbytes = sum(a.nbytes for a in self.arrays.values())

    def __reduce__(self):
        return (unpack, (self.arrays, self.dtypes))


def unpack(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors, as views of ``arrays`` (read-only when they are the object store's:
    the receiver only reads them)."""
    out = {}
    with warnings.catch_warnings():  # torch warns once that the store's buffer is read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, a in arrays.items():
            out[name] = torch.from_numpy(a).view(getattr(torch, dtypes[name]))
    return out
