"""Images through the actor and the learner (docs/vision.md), fast: the episode runner
hands a prompt's images to the engine and every sample of the group shares them; the
learner's packed forward over image prompts (several sequences and images per row) gives
the log-probs transformers gives each sequence alone; a text-only batch carries none.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from fake_engine import FakeEngine

from asyncrl.actor.episode import SingleTurnEpisodes
from asyncrl.engine.settings import SamplingSettings
from asyncrl.learner.batch import collate
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.model import PolicyModel, load_lm, policy_forward
from asyncrl.learner.packing import build_packed
from asyncrl.models.tiny_vlm import TinyVLMSpec, build_tiny_vlm, default_lm_spec, default_task
from asyncrl.tasks.visual import prompt_images
from asyncrl.trajectory import Image, Trajectory, from_bytes, to_bytes

FP32_LOGP_TOL = 1e-4  # one fp32 model, packed vs alone: only kernel order differs


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, tiny_model):
    spec = TinyVLMSpec.defaults(warm_start_steps=0)
    out = tmp_path_factory.mktemp("vlm") / "m"
    return build_tiny_vlm(out, default_task(), spec, default_lm_spec(), measure=False)


def test_the_episode_gives_the_engine_the_images_and_the_group_shares_them(task):
    from asyncrl.models.tiny import build_tokenizer

    engine = FakeEngine(build_tokenizer(task.alphabet), policy=lambda ids: "7")
    sampling = SamplingSettings.defaults(n=3, max_tokens=4)
    vis = default_task()
    prompt = vis.sample(random.Random(1))
    group = asyncio.run(SingleTurnEpisodes(engine, vis, sampling, lambda: 0).run_group(prompt))
    assert engine.images == [prompt.meta["images"]]
    ims = [t.images for t in group.trajectories]
    assert len(ims) == 3 and all(x is ims[0] for x in ims)  # one list, not a copy per sample
    assert ims[0] == [Image.of(prompt.meta["images"][0])]
    back = from_bytes(to_bytes(group.trajectories))
    assert all(t.images[0] is back[0].images[0] for t in back)

    text = asyncio.run(SingleTurnEpisodes(engine, task, sampling, lambda: 0).run_group(
        task.sample(random.Random(1))))  # fmt: skip
    assert engine.images[-1] == [] and all(t.images == [] for t in text.trajectories)
    batch = collate(text.trajectories)
    assert batch.images is None and build_packed(batch, [[0, 1, 2]]).images == []


def _image_trajectories(vlm_dir, groups: int, seed: int = 0):
    """``groups`` prompts x 2 samples of random answer tokens, and each sample's
    log-probs from transformers' forward over that sequence alone."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(vlm_dir)
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    rng, vis = random.Random(seed), default_task()
    trajs, want = [], []
    for g in range(groups):
        p = vis.sample(rng)
        images = [Image.of(png) for png in p.meta["images"]]
        enc = proc(text=p.text, images=prompt_images(p), return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        for i in range(2):
            resp = [rng.randrange(3, 14) for _ in range(rng.randint(1, 4))]
            n = len(resp)
            trajs.append(Trajectory(f"{g}-{i}", str(g), ids, resp, np.zeros(n), np.zeros(n),
                                    np.ones(n, bool), 0.0, images=images))  # fmt: skip
            with torch.no_grad():
                logits = model(
                    input_ids=torch.tensor([ids + resp]), pixel_values=enc["pixel_values"],
                    pixel_attention_mask=enc["pixel_attention_mask"],
                ).logits[0, len(ids) - 1 : -1]  # fmt: skip
            want.append(torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(resp)])
    return trajs, want


def test_the_packed_forward_with_images_is_each_sequence_alone(vlm_dir):
    trajs, want = _image_trajectories(vlm_dir, groups=3)
    lm = load_lm(str(vlm_dir)).eval()
    policy = PolicyModel(lm)
    assert policy.pixels is not None
    batch = collate(from_bytes(to_bytes(trajs)))
    rows = [[0, 3, 4], [1, 2], [5]]  # several sequences (and images) per row, out of order
    pk = build_packed(batch.rows(list(range(6))), rows)
    assert [im.key for im in pk.images] == [trajs[i].images[0].key for i in pk.seqs]
    with torch.no_grad():
        px = policy.pixel_inputs(pk, torch.device("cpu"))
        logits, _ = policy_forward(lm, None, pk.input_ids, pk.position_ids, pk.flat_pos, px)
    got = token_logprobs(logits, pk.targets, 1.0, 0, 1.0)
    diff = (got - torch.cat([want[i] for i in pk.seqs])).abs().max().item()
    assert diff < FP32_LOGP_TOL
    # an image token the policy wrote is a token, not a place for image features
    image_id, others = lm.config.image_token_id, len(got) - len(trajs[5].response_ids)
    trajs[5].response_ids = np.array([5, image_id, 7], np.int32)
    for name in ("behaviour_logprobs", "versions", "loss_mask"):
        setattr(trajs[5], name, getattr(trajs[5], name)[:1].repeat(3))
    wrote = build_packed(collate(trajs), rows)
    with torch.no_grad():
        px = policy.pixel_inputs(wrote, torch.device("cpu"))
        logits, _ = policy_forward(
            lm, None, wrote.input_ids, wrote.position_ids, wrote.flat_pos, px
        )
    lp = token_logprobs(logits, wrote.targets, 1.0, 0, 1.0)
    assert torch.isfinite(lp).all() and (lp[:others] - got[:others]).abs().max() < 1e-5
    # the images matter: another image in their place moves the log-probs
    pk.images = [Image.of(default_task().sample(random.Random(99)).meta["images"][0])] * 6
    with torch.no_grad():
        px = policy.pixel_inputs(pk, torch.device("cpu"))
        moved, _ = policy_forward(lm, None, pk.input_ids, pk.position_ids, pk.flat_pos, px)
    assert (token_logprobs(moved, pk.targets, 1.0, 0, 1.0) - got).abs().max().item() > 1e-3


def test_the_log_the_inspector_and_the_report_show_the_images(tmp_path):
    import base64

    from asyncrl.tools.inspect_run import load_rows, token_table
    from asyncrl.tools.report import write_report
    from asyncrl.utils.runlog import LogSettings, TrajectoryLog

    vis = default_task()
    png = vis.sample(random.Random(2)).meta["images"][0]
    image = Image.of(png)
    log = TrajectoryLog(LogSettings.defaults().spec(tmp_path))
    shown = [Trajectory(f"g-{i}", "g", [15, 16], [5, 6], np.zeros(2), np.zeros(2),
                        np.ones(2, bool), 1.0, response_text="12", images=[image])
             for i in range(2)]  # fmt: skip
    log.write(1, shown, 1)
    log.close()
    rows = load_rows(tmp_path)
    assert [r["images"] for r in rows] == [[f"images/{image.key}.png"]] * 2
    assert f"images/{image.key}.png" in token_table(rows[0])
    page = write_report(tmp_path, rows, tmp_path / "report.html").read_text()
    assert "Images and responses" in page and base64.b64encode(png).decode() in page
    # asyncrl-replay rebuilds the trajectories with their images from the files
    from asyncrl.tools.replay import trajectories_of

    back = trajectories_of({1: {r["traj_id"]: r for r in rows}}, ["g-1"], 1,
                           tmp_path / "trajectories")  # fmt: skip
    assert back[0].images == [image]
