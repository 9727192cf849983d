"""LoRA RL on the learner (``learner.lora.rank > 0``): adapters injected with peft into
the HF model in place, every base weight frozen.

    load_lm ─▶ add_adapters (peft's inject_adapter_in_model; base frozen) ─▶ the optimizer
    sees only the adapters ─▶ adapter_stream: the brokers' weights are the adapters only,
    named and scaled as asyncrl/engine/adapter.py puts them on the wire ─▶ each engine
    merges them into its base weights
    save ─▶ export_adapter: PATH/adapter, a PEFT adapter directory

peft's ``inject_adapter_in_model`` keeps the HF model's own class and forward (the
packed-row forward of learner/model.py runs unchanged); an adapted layer ``M`` holds
``M.base_layer.weight`` (frozen), ``M.lora_A.default.weight`` ``[r, in]`` and
``M.lora_B.default.weight`` ``[out, r]`` (zeros at the start, so version 0 is the base
model on both sides).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from asyncrl.config import ConfigError
from asyncrl.engine.adapter import LORA_A, LORA_B, BaseWeights
from asyncrl.learner.config import LoraSettings

ADAPTER = "default"  # peft's adapter name
PEFT_PREFIX = "base_model.model."  # the key prefix of a saved PEFT adapter's tensors


def lora_config(s: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=list(s.targets),
        bias="none",
    )


def check_targets(model_path: str, s: LoraSettings) -> None:
    """In the driver, before Ray: every ``learner.lora.targets`` entry names a weight
    matrix (not a norm) of the model's decoder layers (from its safetensors names), else a
    ConfigError listing the ones it has. A model that is not a local directory of
    safetensors is left to peft's own check on the learner."""
    if not s.on or not Path(model_path).is_dir():
        return
    names = BaseWeights(model_path).names()
    leaves = sorted({n.split(".")[-2] for n in names
                     if ".layers." in n and n.endswith(".weight") and not n.endswith("norm.weight")})  # fmt: skip
    if not leaves:
        return
    missing = [t for t in s.targets if t not in leaves]
    if missing:
        raise ConfigError(
            f"learner.lora.targets: {missing} name no layer of {model_path}; its decoder "
            f"layers have {leaves}"
        )


def add_adapters(lm: nn.Module, s: LoraSettings) -> nn.Module:
    """``lm`` with an adapter on every ``s.targets`` linear layer, only the adapters
    trainable. ValueError naming the targets when none matches a layer."""
    try:
        from peft import inject_adapter_in_model
    except ImportError as e:  # pragma: no cover - the extra is part of scripts/setup.sh
        raise ImportError("learner.lora.rank > 0 needs peft: pip install 'asyncrl[lora]'") from e
    for p in lm.parameters():
        p.requires_grad_(False)
    try:
        lm = inject_adapter_in_model(lora_config(s), lm, adapter_name=ADAPTER)
    except ValueError as e:
        raise ValueError(f"learner.lora.targets={list(s.targets)}: {e}") from e
    for name, p in lm.named_parameters():
        p.requires_grad_(f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name)
    return lm


def adapter_stream(
    stream: Iterator[tuple[str, torch.Tensor]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors of a learner's ``(name, tensor)`` stream, named and scaled for
    the wire (asyncrl/engine/adapter.py): ``M.lora_A.weight`` as it is, ``M.lora_B.weight``
    times ``scale`` (alpha / r, a new tensor)."""
    a, b = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
    for name, t in stream:
        if name.endswith(a):
            yield name[: -len(a)] + LORA_A, t
        elif name.endswith(b):
            yield name[: -len(b)] + LORA_B, t * scale


def adapter_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as a saved PEFT adapter holds them (``base_model.model.M.lora_A.weight``,
    unscaled), CPU copies."""
    a, b = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
    out = {}
    for name, p in lm.named_parameters():
        for infix, wire in ((a, LORA_A), (b, LORA_B)):
            if name.endswith(infix):
                out[PEFT_PREFIX + name[: -len(infix)] + wire] = p.detach().to("cpu", copy=True)
    return out


def export_adapter(out: Path, lm: nn.Module, s: LoraSettings, base_model: str) -> None:
    """``out``: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors),
    loadable with ``PeftModel.from_pretrained`` over ``base_model`` or by vLLM's
    ``LoRARequest``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(s).to_dict()
    config["base_model_name_or_path"] = base_model
    config["peft_type"] = "LORA"
    config["target_modules"] = sorted(config["target_modules"])
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    state = {k: v.contiguous() for k, v in adapter_state(lm).items()}
    save_file(state, str(out / "adapter_model.safetensors"))
