"""LoRA adapters on the wire and their merge into an engine's base weights.

The learner (``learner.lora``) sends only its adapters, two tensors per adapted linear
layer ``M`` (an HF module name such as ``model.layers.0.self_attn.q_proj``):

    M.lora_A.weight   [r, in]    the down projection
    M.lora_B.weight   [out, r]   the up projection, already multiplied by alpha / r

so the layer's effective weight is ``W0 + B @ A`` with ``W0`` the base checkpoint's
``M.weight``; the receiver needs no LoRA settings of its own. An engine merges each
sync into its weights in place (:func:`merged_weights`, called by the worker extension
with the base weights it read once from the model directory): every adapted layer is
reloaded as ``W0 + B @ A`` (computed in fp32), with the base tensors of whatever else
shares its engine layer, through the same ``reload_weights`` as a full sync, so tokens
are labelled and versioned exactly as after any other update.
Torch only: no engine library is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"


def is_adapter_name(name: str) -> bool:
    return name.endswith(LORA_A) or name.endswith(LORA_B)


def adapter_pairs(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{M: (A, B)}`` of a payload of adapter tensors; ValueError naming the first layer
    with only one of its two tensors, or a tensor that is not an adapter's."""
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name.endswith(LORA_A):
            a[name[: -len(LORA_A)]] = t
        elif name.endswith(LORA_B):
            b[name[: -len(LORA_B)]] = t
        else:
            raise ValueError(f"{name}: not a LoRA adapter tensor (*{LORA_A} or *{LORA_B})")
    lone = sorted(set(a) ^ set(b))
    if lone:
        raise ValueError(f"LoRA payload: {lone[0]} has only one of lora_A / lora_B")
    return {m: (a[m], b[m]) for m in sorted(a)}


def merged_weights(
    tensors: list[tuple[str, torch.Tensor]],
    base: BaseWeights,
    packed: dict[str, list[str]] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """``[(M.weight, W0 + B @ A)]`` for every layer of an adapter payload (``W0`` the base
    checkpoint's tensor, the result in its dtype, computed in fp32), plus the base tensors
    of every engine layer those touch that the payload does not: each adapted module's
    bias, and the un-adapted siblings packed into the same engine layer (``packed``, the
    engine model's ``packed_modules_mapping``: ``{"qkv_proj": ["q_proj", "k_proj",
    "v_proj"], ...}``). An engine layer reloads from what is given, so each one touched
    gets all of its tensors."""
    pairs = adapter_pairs(tensors)
    modules: list[str] = []
    for module in pairs:
        prefix, _, leaf = module.rpartition(".")
        group = next((g for g in (packed or {}).values() if leaf in g), [leaf])
        modules += [f"{prefix}.{x}" if prefix else x for x in group]
    out = []
    for module in dict.fromkeys(modules):  # in order, once
        name = f"{module}.weight"
        w0 = base(name)
        if module in pairs:
            a, b = pairs[module]
            delta = b.to(torch.float32) @ a.to(torch.float32)
            if delta.shape != w0.shape:
                raise ValueError(
                    f"{name}: adapter update {tuple(delta.shape)} does not fit the base "
                    f"weight {tuple(w0.shape)}"
                )
            w0 = (w0.to(torch.float32) + delta).to(w0.dtype)
        out.append((name, w0))
        if base.has(f"{module}.bias"):
            out.append((f"{module}.bias", base(f"{module}.bias")))
    return out


class BaseWeights:
    """The base checkpoint's tensors of a local HF model directory, read on first use
    (only the adapted layers' weights), kept for every later merge."""

    def __init__(self, model_dir: str):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ValueError(
                f"LoRA sync needs the engine's model as a local directory, got {model_dir!r}"
            )
        self._where: dict[str, Path] | None = None
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            from safetensors import safe_open

            path = self._files().get(name)
            if path is None:
                raise KeyError(f"{name}: not in the base checkpoint {self.dir}")
            with safe_open(str(path), framework="pt") as f:
                t = self._cache[name] = f.get_tensor(name)
        return t

    def has(self, name: str) -> bool:
        return name in self._files()

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return sorted(self._files())

    def _files(self) -> dict[str, Path]:
        if self._where is None:
            index = self.dir / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {k: self.dir / v for k, v in weight_map.items()}
            else:
                from safetensors import safe_open

                self._where = {}
                for path in sorted(self.dir.glob("*.safetensors")):
                    with safe_open(str(path), framework="pt") as f:
                        self._where.update((k, path) for k in f.keys())
        return self._where
