"""What the learner needs to know of an HF model's architecture, checked once at
start-up (models/resolve.py) and used by the learner's FSDP wrapping."""

from __future__ import annotations

from torch import nn


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The transformer blocks (FSDP shards one unit per block): the decoder's ``layers``
    (Llama, Qwen, Mistral, Gemma, ...) or else, for any other HF model, the longest
    ModuleList whose entries are all of a class the model names in ``_no_split_modules``
    (HF's own list of its blocks, e.g. GPT-2's ``h`` of ``GPT2Block``)."""
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    blocks = set(getattr(lm, "_no_split_modules", None) or ())
    found = [
        m
        for m in lm.modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(type(b).__name__ in blocks for b in m)
    ]
    if not found:
        model_type = getattr(getattr(lm, "config", None), "model_type", "?")
        raise ValueError(
            f"{type(lm).__name__} (model_type {model_type}): cannot find its decoder layers "
            "(neither `get_decoder().layers` nor a list of its `_no_split_modules` blocks), "
            "which the learner's FSDP wrapping shards; this architecture is not supported"
        )
    return max(found, key=len)


# What HF vision-language models call their image encoder: Idefics3 / SmolVLM / Mllama,
# LLaVA / Gemma 3, Qwen2-VL / Qwen2.5-VL.
VISION_TOWERS = ("vision_model", "vision_tower", "visual")


def tower_layers(lm: nn.Module) -> nn.ModuleList | None:
    """The vision tower's blocks (FSDP shards one unit per block, as it does the decoder
    layers): the longest ModuleList of blocks of one class inside the model's image
    encoder, found by its name in :data:`VISION_TOWERS` on the model or on its
    ``model``; None for a text model or a tower without such a list."""
    for holder in (lm, getattr(lm, "model", None)):
        tower = next(
            (t for n in VISION_TOWERS if isinstance(t := getattr(holder, n, None), nn.Module)),
            None,
        )
        if tower is not None:
            found = [
                m
                for m in tower.modules()
                if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1
            ]
            return max(found, key=len) if found else None
    return None
