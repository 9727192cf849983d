"""task=visual_addition (asyncrl/tasks/visual.py): the operands only in a seeded image."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncrl.config import ConfigError, compose_config
from asyncrl.tasks.base import Prompt, TaskSampler
from asyncrl.tasks.visual import (
    IMAGE_PLACEHOLDER,
    VisualAdditionTask,
    prompt_images,
    render_with_centres,
)


def _draws(seed: int, n: int, **kw) -> list:
    s = TaskSampler(VisualAdditionTask(**kw), seed)
    return [s.next() for _ in range(n)]


def test_the_prompt_text_is_the_placeholder_and_the_answer_the_sum():
    for p in _draws(0, 20):
        a, b = p.meta["operands"]
        assert p.text == IMAGE_PLACEHOLDER
        assert p.answer == str(a + b) and p.meta["shown"] == f"{a}+{b}="
        (img,) = prompt_images(p)
        assert img.mode == "RGB" and img.size == (64, 64)


def test_the_same_seed_draws_the_same_pixels_and_another_seed_others():
    one, again, other = _draws(7, 10), _draws(7, 10), _draws(8, 10)
    assert [p.meta["images"] for p in one] == [p.meta["images"] for p in again]
    assert [p.meta["operands"] for p in one] == [p.meta["operands"] for p in again]
    assert [p.meta["images"] for p in one] != [p.meta["images"] for p in other]


def test_a_resumed_sampler_continues_with_the_same_images():
    s = TaskSampler(VisualAdditionTask(), 3)
    s.next()
    state = s.state_dict()
    want = s.next()
    t = TaskSampler(VisualAdditionTask(), 0)
    t.load_state_dict(state)
    assert t.next().meta["images"] == want.meta["images"]


def _ink_box(img) -> tuple[int, int, int, int]:
    """The bounding box of the pixels darker than the paper (noise-free images)."""
    a = np.asarray(img.convert("L"), dtype=np.int32)
    ys, xs = np.nonzero(a < a.max() - 20)
    return xs.min(), ys.min(), xs.max(), ys.max()


def test_the_text_is_drawn_whole_at_varied_places_and_sizes():
    boxes = []
    for p in _draws(1, 40, noise=0.0, layout="free"):
        (img,) = prompt_images(p)
        a = np.asarray(img.convert("L"))
        assert a.min() <= 96 and a.max() >= 159  # ink on paper, legible
        x0, y0, x1, y1 = _ink_box(img)
        assert 0 <= x0 and x1 < 64 and 0 <= y0 and y1 < 64
        boxes.append((x0, y0, x1 - x0, y1 - y0))
    xs, ys, widths, heights = zip(*boxes)
    assert len(set(xs)) > 10 and len(set(ys)) > 10  # positions vary
    assert len(set(heights)) >= 3  # so do the font sizes


def test_the_cells_layout_puts_each_character_in_its_cell_of_the_bottom_row():
    from asyncrl.tasks.visual import CELL_JITTER

    task = VisualAdditionTask(layout="cells", noise=0.0)
    rng, lefts = random.Random(4), set()
    for _ in range(40):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        text = f"{a}+{b}="
        img, centres = task.draw(text, rng)
        cells = [(int(x // task.cell), int(y // task.cell)) for x, y in centres]
        assert cells == [(c, 7) for c in range(8 - len(text), 8)]  # the last in the last cell
        for (x, _), (c, _) in zip(centres, cells):
            assert abs(x - (c + 0.5) * task.cell) <= CELL_JITTER
        x0, y0, x1, y1 = _ink_box(img)
        assert 64 - task.cell <= y1 <= 62  # whole, ending in the bottom row
        assert y0 >= 64 - 2 * task.cell
        assert x0 >= (8 - len(text)) * task.cell - 2  # nothing left of its first cell
        lefts.add(x0 - (8 - len(text)) * task.cell)
    assert len(lefts) >= 3  # the glyphs move within their cells


def test_noise_moves_pixels_but_keeps_the_drawing():
    rng_a, rng_b = random.Random(5), random.Random(5)
    clean = np.asarray(render_with_centres("13+7=", 64, (12,), 0.0, rng_a)[0], dtype=np.float32)
    noisy = np.asarray(render_with_centres("13+7=", 64, (12,), 8.0, rng_b)[0], dtype=np.float32)
    diff = noisy - clean
    assert 4.0 < diff.std() < 12.0  # ~ the noise's sd, clipped at 0 and 255
    assert abs(diff.mean()) < 4.0  # clipping at white paper shifts it a little


def test_reward_is_the_exact_sum():
    t = VisualAdditionTask()
    p = _draws(2, 1)[0]
    assert t.reward(p, p.answer)["reward"] == 1.0
    assert t.reward(p, f" {p.answer}\n")["reward"] == 1.0
    assert t.reward(p, p.answer + "0")["reward"] == 0.0
    assert t.reward(p, "")["reward"] == 0.0
    half = VisualAdditionTask(partial_credit=0.5)
    twenty = Prompt(text=IMAGE_PLACEHOLDER, answer="20")
    assert half.reward(twenty, "21") == {"reward": 0.25, "exact": 0.0, "digits": 0.5, "format": 1.0}


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"max_operand": 0}, "task.max_operand"),
        ({"image_size": 8}, "task.image_size"),
        ({"noise": -1.0}, "task.noise"),
        ({"font_sizes": []}, "task.font_sizes"),
        ({"image_size": 32, "font_sizes": [30]}, "task.image_size"),  # the text cannot fit
        ({"layout": "grid"}, "task.layout"),
        ({"layout": "cells", "cell": 12}, "task.image_size"),  # 6 cells of 12 px > 64
        ({"cell": 2}, "task.cell"),
    ],
)
def test_bad_settings_are_refused_by_name(kw, key):
    with pytest.raises(ValueError, match=key):
        VisualAdditionTask(**kw)


def test_the_config_builds_it_and_refuses_a_bad_value_at_start_up():
    from asyncrl.wiring import build_task

    task = build_task(compose_config(["task=visual_addition"]))
    assert isinstance(task, VisualAdditionTask) and task.font_sizes == (0, 10, 12, 14)
    with pytest.raises(ConfigError, match="task.noise"):
        build_task(compose_config(["task=visual_addition", "task.noise=500"]))


def test_the_vlm_resolves_for_its_task_and_is_refused_for_another():
    import json

    from asyncrl.models.resolve import resolve_model
    from asyncrl.models.shipped import TINY_VLM
    from asyncrl.tasks.arithmetic import AdditionTask

    cfg = compose_config(["model=tiny_vlm", "task=visual_addition"])
    with pytest.raises(ConfigError, match="model=tiny_vlm"):
        resolve_model(cfg, AdditionTask())
    short = compose_config(["model=tiny_vlm", "actor.engine.max_model_len=64"])
    with pytest.raises(ConfigError, match="actor.engine.max_model_len=64: .* at least 70"):
        resolve_model(short, VisualAdditionTask())  # before any build or engine
    long = compose_config(["model=tiny_vlm", "actor.engine.max_model_len=512"])
    with pytest.raises(ConfigError, match="model.vlm.max_positions=160"):
        resolve_model(long, VisualAdditionTask())
    got = resolve_model(cfg, VisualAdditionTask())  # the shipped model, copied
    assert TINY_VLM.is_current(got)  # the default config asks for the shipped one
    assert json.loads(open(f"{got}/config.json").read())["model_type"] == "idefics3"
