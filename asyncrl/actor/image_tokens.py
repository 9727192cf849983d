"""Image placeholders in a multi-turn episode's token ids, two forms of one sequence.

    compact:  one placeholder token per image (``<image>``): what a request to the engine
              holds; the engine's processor expands each into that image's tokens
    expanded: each placeholder replaced by the image's tokens (Idefics3: 19 for one
              ``<image>``): what the engine's model reads, hence what the trajectory holds

An episode's first request is the prompt's text and its images: the engine reports the
expanded prompt ids, which :meth:`ImageTokens.collapse` folds back to the compact form.
An observation's text with placeholders (and its images) is tokenized once, compact, and
:meth:`ImageTokens.expand` replaces each placeholder by the model's processor's
expansion of its image, exactly as vLLM's prompt update does in token space (its target
is the placeholder token, its replacement the processor's tokens for that image). The
next request sends the compact sequence with every image of the episode so far, and the
engine's expanded prompt must equal the trajectory's ids (the runner checks it).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from asyncrl.models.resolve import image_processor
from asyncrl.trajectory import Image

SIZES_KEPT = 256  # image sizes whose tokens are kept: an env shows a few sizes, not many


class ImageTokens:
    """The model's own processor (its directory's ``processor_config.json``, which vLLM
    reads too) as the runner needs it: the placeholder token and each image's tokens."""

    def __init__(self, model_path: str):
        self.processor = image_processor(model_path)  # ValueError: a model without images
        self.placeholder = str(self.processor.image_token)
        self.placeholder_id = int(self.processor.tokenizer.convert_tokens_to_ids(self.placeholder))
        self._by_size: dict[tuple[int, int], list[int]] = {}

    def tokens_of(self, image: Image) -> list[int]:
        """The processor's tokens for one image (its placeholder expanded alone). They
        depend on the image's size only (vLLM's Idefics3 replacement is computed from the
        width and height alone), so each size is processed once: after that, the event
        loop reads a PNG header, no pixels."""
        from PIL import Image as PIL

        pil = PIL.open(io.BytesIO(image.png))
        got = self._by_size.get(pil.size)
        if got is None:
            rgb = pil.convert("RGB")
            out = self.processor(text=self.placeholder, images=[[rgb]], add_special_tokens=False)
            got = [int(i) for i in out["input_ids"][0]]
            if len(self._by_size) < SIZES_KEPT:
                self._by_size[pil.size] = got
        return got

    def expand(self, compact: Sequence[int], images: Sequence[Image]) -> list[int]:
        """``compact`` with its i-th placeholder replaced by ``images[i]``'s tokens; a
        count that differs raises ValueError."""
        have = sum(1 for i in compact if i == self.placeholder_id)
        if have != len(images):
            raise ValueError(
                f"{have} {self.placeholder} placeholders for {len(images)} images: "
                "an observation shows one image per placeholder, in order"
            )
        out: list[int] = []
        it = iter(images)
        for tok in compact:
            out += self.tokens_of(next(it)) if tok == self.placeholder_id else [int(tok)]
        return out

    def collapse(self, expanded: Sequence[int], images: Sequence[Image]) -> list[int]:
        """The compact form of ``expanded``: each image's tokens, found in order, folded
        back into one placeholder (ValueError if one is missing)."""
        ids, out, pos = list(expanded), [], 0
        for k, image in enumerate(images):
            block = self.tokens_of(image)
            at = find(ids, block, pos)
            if at < 0:
                raise ValueError(
                    f"image {k}'s {len(block)} tokens are not in the engine's prompt ids: "
                    "the engine expanded it otherwise than the model's processor"
                )
            out += ids[pos:at] + [self.placeholder_id]
            pos = at + len(block)
        return out + ids[pos:]

    def check_request(self, compact: Sequence[int], images: Sequence[Image]) -> None:
        """A request's placeholders are its images': a placeholder token the policy wrote
        would take an image's place in the engine (ValueError, the episode's error)."""
        have = sum(1 for i in compact if i == self.placeholder_id)
        if have != len(images):
            raise ValueError(
                f"the request holds {have} {self.placeholder} tokens for {len(images)} "
                "images: the policy wrote an image placeholder, which the engine would "
                "read as an image"
            )


def find(ids: list[int], block: list[int], start: int) -> int:
    """The first index ``>= start`` where ``block`` occurs in ``ids``; -1 if none."""
    n = len(block)
    first = block[0] if block else None
    for i in range(start, len(ids) - n + 1):
        if ids[i] == first and ids[i : i + n] == block:
            return i
    return -1


def tokenizer_path(tokenizer: Any) -> str:
    """The model directory the engine's tokenizer came from (its processor's too)."""
    path = str(getattr(tokenizer, "name_or_path", "") or "")
    if not path:
        raise ValueError("the engine's tokenizer names no model directory to read images with")
    return path
