"""A vision-language model on two FSDP ranks (Ray actors, gloo, CPU) against one plain
rank: every block of the vision tower is an FSDP unit of its own, as every decoder
layer is, and the two ranks give the one rank's log-probs on image trajectories, its
loss and grad norm for a step on them, and its weights when streamed out."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.group import LearnerGroup
from asyncrl.learner.learner import Learner
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.models.tiny_vlm import TinyVLMSpec, build_tiny_vlm, default_lm_spec, default_task
from asyncrl.tasks.visual import prompt_images
from asyncrl.trajectory import Image, Trajectory

LOGP_ATOL = 1e-5  # fp32, packed differently on the two sides
REL_TOL = 1e-5  # loss and grad norm, summed in another order over two ranks
PARAM_ATOL = 5e-5  # any parameter after one step at lr 1e-3


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, tiny_model):
    spec = TinyVLMSpec.defaults(warm_start_steps=0, warm_start_read_steps=0)
    out = tmp_path_factory.mktemp("vlm") / "m"
    return build_tiny_vlm(out, default_task(), spec, default_lm_spec(), measure=False)


def image_groups(vlm_dir, groups: int, seed: int) -> list[Trajectory]:
    """``groups`` image prompts x 4 samples of random answer tokens, rewards 0 or 1."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(vlm_dir)
    rng, task = random.Random(seed), default_task()
    out = []
    for g in range(groups):
        p = task.sample(rng)
        ids = proc(text=p.text, images=prompt_images(p), return_tensors="pt")["input_ids"][0]
        images = [Image.of(png) for png in p.meta["images"]]
        for i in range(4):
            n = rng.randint(1, 4)
            out.append(
                Trajectory(
                    f"{g}-{i}", f"g{g}", ids.tolist(), [rng.randrange(3, 14) for _ in range(n)],
                    -np.full(n, 2.5, np.float32), np.zeros(n, np.int32), np.ones(n, bool),
                    float(i % 2), images=images,
                )
            )  # fmt: skip
    return out


def tower_units(rank) -> list[str]:
    """The classes of the FSDP units on a learner rank's Ray actor, root first."""
    from asyncrl.learner.dist import fsdp_units

    return [type(m).__name__ for m, _ in fsdp_units(rank.learner.policy)]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-12)


def test_the_tower_blocks_are_found_in_a_vlm_and_none_in_a_text_model(vlm_dir, tiny_model):
    from asyncrl.learner.model import load_lm
    from asyncrl.models.arch import tower_layers

    blocks = tower_layers(load_lm(str(vlm_dir)))
    assert blocks is not None and [type(b).__name__ for b in blocks] == ["Idefics3EncoderLayer"] * 2
    assert tower_layers(load_lm(str(tiny_model))) is None


@pytest.mark.slow
def test_two_ranks_shard_the_tower_by_block_and_match_one(ray_local, vlm_dir):
    from ray import cloudpickle

    ray = ray_local
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tower_units, on a rank
    torch.set_num_threads(1)
    kw = dict(num_threads=1, micro_batch_tokens=10_000)
    one = Learner(str(vlm_dir), ClippedISLoss(), GroupNormalized(), LearnerSettings.defaults(**kw))
    group = LearnerGroup(
        str(vlm_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(world_size=2, **kw),
    )  # fmt: skip
    try:
        units = ray.get(group.ranks[0].__ray_call__.remote(tower_units))
        # fully_shard renames each unit's class FSDP<class>
        assert (
            units
            == ["FSDPPolicyModel"]
            + ["FSDPIdefics3EncoderLayer"] * 2
            + ["FSDPLlamaDecoderLayer"] * 2
        ), units

        held = image_groups(vlm_dir, 2, seed=7)
        for a, b in zip(one.logprobs_of(held), group.logprobs_of(held), strict=True):
            np.testing.assert_allclose(a, b, atol=LOGP_ATOL)
        batch = collate(image_groups(vlm_dir, 4, seed=3))
        m1, m2 = one.step_on_batch(batch, 0), group.step_on_batch(batch, 0)
        for k in ("loss/total", "learner/grad_norm"):
            assert close(m1[k], m2[k]), (k, m1[k], m2[k])
        p1 = one.full_state_dict()
        streamed = {k: v.clone() for k, v in group.named_parameters_stream()}
        assert streamed.keys() == p1.keys()
        assert any(k.startswith("model.vision_model.encoder.layers.1.") for k in streamed)
        worst = max(float((p1[k] - streamed[k]).abs().max()) for k in p1)
        assert worst < PARAM_ATOL, worst
        moved = max(
            float((p1[k] - v).abs().max())
            for k, v in Learner(
                str(vlm_dir), ClippedISLoss(), GroupNormalized(), LearnerSettings.defaults(**kw)
            ).full_state_dict().items()
            if k.startswith("model.vision_model.encoder.")
        )  # fmt: skip
        assert moved > PARAM_ATOL  # the step moved the tower: the comparison has teeth
    finally:
        group.close()
