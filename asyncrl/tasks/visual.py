"""``task=visual_addition``: addition whose operands are only in an image.

Each prompt is one small RGB image of ``"13+7="`` drawn with Pillow's built-in default
font (FreeType at a random size, or the bitmap font; no font file is read or fetched)
in a random ink on a random paper, with pixel noise, laid out by ``layout``: ``"free"``,
the whole text at a random position; ``"cells"``, one character per cell of ``cell`` px in
the image's bottom row of cells, the text's last character in the last cell, each
character moved by up to :data:`CELL_JITTER` px either way. The prompt's text is only the
image placeholder (:data:`IMAGE_PLACEHOLDER`, which the model's
processor expands into its image tokens). The reward is the exact sum, scored like
:class:`~asyncrl.tasks.arithmetic.AdditionTask`'s plain form.

The image travels as PNG bytes in ``Prompt.meta["images"]`` (lossless, a few hundred
bytes, cheap to pickle and to hash); :func:`prompt_images` decodes them to PIL. A prompt
is a function of the rng's state alone: the same seed draws the same operands and the
same pixels.
"""

from __future__ import annotations

import io
import random
from typing import Any

from asyncrl.tasks.arithmetic import ALPHABET
from asyncrl.tasks.base import Prompt, digit_credit

IMAGE_PLACEHOLDER = "<image>"  # one image's place in the prompt (the VLM processor's token)
BITMAP_FONT = 0  # a font size of 0 draws with Pillow's bitmap font (fixed ~11 px glyphs)
PAPER_MAX_INK = 96  # ink is at most this bright and paper at least 255 - this: text stays legible
LAYOUTS = ("free", "cells")
CELL_JITTER = 1  # layout "cells": each character's centre moves up to this many px either way


class VisualAdditionTask:
    """Sums of ``num_operands`` integers in [0, ``max_operand``] shown as an image of
    ``image_size`` x ``image_size`` pixels. ``font_sizes``: the FreeType sizes drawn
    from (0 = the bitmap font); ``noise``: the pixel noise's standard deviation, in
    units of the 0-255 scale; ``layout`` and ``cell``: where the characters go (the
    module's docstring)."""

    def __init__(
        self,
        max_operand: int = 19,
        num_operands: int = 2,
        image_size: int = 64,
        font_sizes: tuple[int, ...] | list[int] = (0, 10, 12, 14),
        noise: float = 8.0,
        partial_credit: float = 0.0,
        layout: str = "cells",
        cell: int = 8,
    ):
        if max_operand < 1:
            raise ValueError(f"task.max_operand must be >= 1, got {max_operand}")
        if num_operands < 2:
            raise ValueError(f"task.num_operands must be >= 2, got {num_operands}")
        if not 16 <= image_size <= 1024:
            raise ValueError(f"task.image_size={image_size}: expected an integer in [16, 1024]")
        if not font_sizes or any(not 0 <= s <= 256 for s in font_sizes):
            raise ValueError(f"task.font_sizes={list(font_sizes)}: expected sizes in [0, 256]")
        if not 0.0 <= noise <= 128.0:
            raise ValueError(f"task.noise={noise}: expected a number in [0, 128]")
        if layout not in LAYOUTS:
            raise ValueError(f"task.layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
        if not 4 <= cell <= image_size:
            raise ValueError(f"task.cell={cell}: expected an integer in [4, task.image_size]")
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.image_size = image_size
        self.font_sizes = tuple(int(s) for s in font_sizes)
        self.noise = float(noise)
        self.partial_credit = partial_credit
        self.layout = layout
        self.cell = int(cell)
        widest = "+".join([str(max_operand)] * num_operands) + "="
        if layout == "cells" and len(widest) * self.cell > image_size:
            raise ValueError(
                f"task.image_size={image_size}: {widest!r} needs {len(widest)} cells of "
                f"task.cell={cell} px; use a larger image or smaller cells"
            )
        if max(text_size(widest, s)[0] for s in self.font_sizes) > image_size:
            raise ValueError(
                f"task.image_size={image_size}: {widest!r} does not fit at font size "
                f"{max(self.font_sizes)}; use a larger image or smaller task.font_sizes"
            )

    @property
    def alphabet(self) -> str:
        return ALPHABET

    @property
    def max_response_chars(self) -> int:
        return len(str(self.max_operand * self.num_operands))

    def sample(self, rng: random.Random) -> Prompt:
        return self.sample_with_centres(rng)[0]

    def sample_with_centres(self, rng: random.Random) -> tuple[Prompt, list[tuple[float, float]]]:
        """:meth:`sample`'s prompt (the same draws from ``rng``) and the pixel centre of
        each character of ``meta["shown"]`` in its image (:func:`render_with_centres`)."""
        xs = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        text = "+".join(map(str, xs)) + "="
        image, centres = self.draw(text, rng)
        prompt = Prompt(
            text=IMAGE_PLACEHOLDER,
            answer=str(sum(xs)),
            meta={"operands": xs, "shown": text, "images": [png_bytes(image)]},
        )
        return prompt, centres

    def draw(self, text: str, rng: random.Random) -> tuple[Any, list[tuple[float, float]]]:
        """``text`` drawn in this task's layout (every draw from ``rng``): the RGB image
        and each character's (x, y) pixel centre in it."""
        if self.layout == "cells":
            return render_cells(text, self.image_size, self.cell, self.font_sizes, self.noise, rng)
        return render_with_centres(text, self.image_size, self.font_sizes, self.noise, rng)

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        got = completion.strip()
        return {
            **digit_credit(got, prompt.answer, self.partial_credit),
            "format": float(got.isdigit()),
        }


def font(size: int) -> Any:
    """Pillow's built-in font: FreeType at ``size`` px, or the bitmap font for 0."""
    from PIL import ImageFont

    return (
        ImageFont.load_default_imagefont() if size == BITMAP_FONT else ImageFont.load_default(size)
    )


def text_size(text: str, size: int) -> tuple[int, int]:
    """(width, height) in pixels of ``text`` drawn at font ``size``."""
    left, top, right, bottom = font(size).getbbox(text)
    return right - left, bottom - top


def render_with_centres(
    text: str, image_size: int, font_sizes: tuple[int, ...], noise: float, rng: random.Random
) -> tuple[Any, list[tuple[float, float]]]:
    """Layout ``"free"``: an RGB PIL image of ``text`` at a random font size and position
    (the whole text inside the image), ink and paper gray levels, and Gaussian pixel
    noise, every draw from ``rng``; and the (x, y) pixel centre of each of ``text``'s
    characters in it: where the drawing put them, what a warm start supervises the
    vision tower's tokens with."""

    from PIL import ImageDraw

    size = rng.choice(font_sizes)
    f = font(size)
    left, top, right, bottom = f.getbbox(text)
    x = rng.randint(0, max(0, image_size - (right - left))) - left
    y = rng.randint(0, max(0, image_size - (bottom - top))) - top
    img, ink = paper_for(image_size, rng)
    ImageDraw.Draw(img).text((x, y), text, fill=ink, font=f)
    mid_y = y + (top + bottom) / 2
    centres = [
        (x + (f.getlength(text[:i]) + f.getlength(text[: i + 1])) / 2, mid_y)
        for i in range(len(text))
    ]
    return with_noise(img, noise, rng), centres


def render_cells(
    text: str, image_size: int, cell: int, font_sizes: tuple[int, ...], noise: float,
    rng: random.Random,
) -> tuple[Any, list[tuple[float, float]]]:  # fmt: skip
    """Layout ``"cells"``: the text's characters centred in the cells (``cell`` px
    square) of the image's bottom row, the last character in the last cell, the text's
    bottom edge 1 to 1 + :data:`CELL_JITTER` px above the image's and each
    character moved by up to :data:`CELL_JITTER` px sideways; a random
    font size, ink and paper, then pixel noise. Returns the RGB image and each
    character's (x, y) centre."""
    from PIL import ImageDraw

    size = rng.choice(font_sizes)
    f = font(size)
    _, top, _, bottom = f.getbbox(text)
    y = image_size - 1 - bottom - rng.randint(0, CELL_JITTER)  # the glyphs' bottom edge
    mid_y = y + (top + bottom) / 2
    img, ink = paper_for(image_size, rng)
    draw, centres = ImageDraw.Draw(img), []
    for i, ch in enumerate(text):
        cx = image_size - (len(text) - i - 0.5) * cell + rng.randint(-CELL_JITTER, CELL_JITTER)
        draw.text((cx - f.getlength(ch) / 2, y), ch, fill=ink, font=f)
        centres.append((cx, mid_y))
    return with_noise(img, noise, rng), centres


def paper_for(image_size: int, rng: random.Random) -> tuple[Any, int]:
    """A blank grayscale image of a random paper shade and the random ink to draw on it."""
    from PIL import Image

    ink = rng.randint(0, PAPER_MAX_INK)
    return Image.new("L", (image_size, image_size), rng.randint(255 - PAPER_MAX_INK, 255)), ink


def with_noise(img, noise: float, rng: random.Random):
    """``img`` with Gaussian pixel noise of sd ``noise`` (seeded from ``rng``), as RGB."""
    import numpy as np
    from PIL import Image

    if noise > 0:
        gen = np.random.default_rng(rng.getrandbits(64))
        pixels = np.asarray(img, dtype=np.float32) + gen.normal(0.0, noise, img.size[::-1])
        img = Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8), mode="L")
    return img.convert("RGB")


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def prompt_images(prompt: Prompt) -> list[Any]:
    """The prompt's images as RGB PIL images (none for a text-only prompt)."""
    from PIL import Image

    return [Image.open(io.BytesIO(b)).convert("RGB") for b in prompt.meta.get("images", ())]
