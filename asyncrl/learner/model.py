"""The learner's module: an HF causal LM plus an optional value head.

The forward runs the decoder on packed rows and applies the LM head (and value head)
only at the positions that predict response tokens, so a large vocabulary costs
``N x V`` logits, not ``R x S x V``. :class:`PolicyModel` exists so FSDP has one root
module whose forward covers the decoder, the LM head and the value head; without FSDP
the same :func:`policy_forward` runs on the bare HF model.

An image-text model (its config has a ``vision_config``: model=tiny_vlm's Idefics3)
loads as transformers' AutoModelForImageTextToText. A micro-batch whose rows show
images (``PackedRows.images``, in the order their placeholder tokens appear in the
packed ids, a prompt's and an episode's observations' alike) gets their pixels from the model's own image processor
(:class:`ImagePixels`: the PNG bytes in, the settings vLLM's processor reads too);
the model runs its vision tower and connector once per image and puts the features at
the image tokens' positions the policy did not generate, then the decoder runs as for
text. A text-only micro-batch
takes the text path unchanged.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from asyncrl.learner.packing import PackedRows

# Names of the parameters of :class:`PolicyModel` that are not the HF model's.
LM_PREFIX = "lm."
VALUE_PREFIX = "value_head."


def policy_forward(
    lm: nn.Module,
    value_head: nn.Module | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    flat_pos: torch.Tensor,
    pixels: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids``/``position_ids`` ``[R, S]``, ``flat_pos`` ``[N]`` -> logits ``[N, V]``
    and values ``[N]`` (fp32) or None. No attention mask: the restarting position ids
    make HF build the block-diagonal causal mask of packed sequences. ``pixels``: the
    micro-batch's images as the model's forward takes them (:class:`ImagePixels`), or
    None (text only)."""
    if pixels is None:
        h = lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    else:
        embeds = image_embeds(lm, input_ids, pixels)
        h = lm.get_decoder()(inputs_embeds=embeds, position_ids=position_ids, use_cache=False)
    h = h.last_hidden_state
    h = h.reshape(-1, h.shape[-1]).index_select(0, flat_pos)
    logits = lm.get_output_embeddings()(h)
    values = value_head(h).squeeze(-1).float() if value_head is not None else None
    return logits, values


def image_embeds(
    lm: nn.Module, input_ids: torch.Tensor, pixels: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The input embeddings ``[R, S, D]`` with each image's features (its vision tower
    and connector, once per image) in its placeholder tokens: ``pixels["image_tokens"]``
    ``[R, S]`` marks the image tokens of the prompts and observations only (the tokens
    outside the loss mask), so an image token the policy generated keeps its own
    embedding (as in the engine, which puts features only where its processor expanded a
    placeholder)."""
    embeds = lm.get_input_embeddings()(input_ids)
    where = pixels["image_tokens"]
    out = lm.get_image_features(
        pixel_values=pixels["pixel_values"], pixel_attention_mask=pixels["pixel_attention_mask"]
    )
    feats = out.pooler_output.reshape(-1, embeds.shape[-1])
    if feats.shape[0] != int(where.sum()):
        raise ValueError(
            f"{feats.shape[0]} image feature tokens for {int(where.sum())} image tokens in the "
            "prompts and observations: the rows' images do not match their placeholders"
        )
    return embeds.masked_scatter(where[..., None], feats.to(embeds.dtype))


class ImagePixels:
    """The model's own image processor (``model_path``'s ``processor_config.json``):
    :class:`~asyncrl.trajectory.Image` s -> the ``pixel_values`` and
    ``pixel_attention_mask`` its forward takes (one image per entry, in order)."""

    def __init__(self, model_path: str, image_token_id: int):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = image_token_id

    def __call__(self, pk: PackedRows, device: torch.device) -> dict[str, torch.Tensor]:
        """``pixel_values``, ``pixel_attention_mask`` and ``image_tokens`` (the prompts' and
        observations' image tokens, ``[R, S]`` bool) of the micro-batch ``pk``."""
        from PIL import Image as PIL

        pil = [[PIL.open(io.BytesIO(im.png)).convert("RGB")] for im in pk.images]
        out = self.processor(images=pil, return_tensors="pt")
        got = {k: out[k].to(device) for k in ("pixel_values", "pixel_attention_mask")}
        tokens = (pk.input_ids == self.image_token_id) & pk.context_mask
        return {**got, "image_tokens": tokens.to(device)}


def has_vision(config: object) -> bool:
    """Whether an HF config is an image-text model's (it names a vision tower)."""
    return getattr(config, "vision_config", None) is not None


class PolicyModel(nn.Module):
    def __init__(self, lm: nn.Module, value_head: bool = False):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1) if value_head else None
        self.pixels = (
            ImagePixels(lm.name_or_path, lm.config.image_token_id)
            if has_vision(lm.config)
            else None
        )

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, flat_pos: torch.Tensor,
        pixels: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        return policy_forward(self.lm, self.value_head, input_ids, position_ids, flat_pos, pixels)

    def pixel_inputs(self, pk: PackedRows, device: torch.device) -> dict[str, torch.Tensor] | None:
        """A micro-batch's images as the forward takes them; None without images."""
        if not pk.images:
            return None
        if self.pixels is None:
            raise ValueError(f"rows carry {len(pk.images)} images; the model has no vision tower")
        return self.pixels(pk, device)


def load_lm(model_path: str, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = has_vision(AutoConfig.from_pretrained(model_path))
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    lm = auto.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    lm.train()
    return lm
