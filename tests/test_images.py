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
IMAGE_TOKENS = TinyVLMSpec.defaults().image_seq_len  # <image> tokens per image
IMAGE_IDS = 3 + IMAGE_TOKENS  # one image's ids: <fake><global-img>, its tokens, <fake>


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, tiny_model):
    spec = TinyVLMSpec.defaults(warm_start_steps=0, warm_start_read_steps=0)
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


def test_evaluation_gives_the_engine_each_prompts_images(task):
    """The evaluator's single-turn scoring sends an image prompt's images with it, greedy
    and sampled alike (without them the engine reads the bare placeholder)."""
    from asyncrl.eval.actor import SetScorer
    from asyncrl.eval.settings import EvalSettings
    from asyncrl.models.tiny import build_tokenizer

    engine = FakeEngine(build_tokenizer(task.alphabet), policy=lambda ids: "7")
    vis = default_task()
    prompts = [vis.sample(random.Random(seed)) for seed in range(3)]
    scorer = SetScorer(engine, EvalSettings.defaults(k=2), 4, 0)
    asyncio.run(scorer.score(vis, prompts))
    want = [p.meta["images"] for p in prompts]
    assert engine.images == want + want  # the greedy requests, then the sampled ones


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


def _processor_engine(vlm_dir, answer: str):
    """A FakeEngine on the VLM's tokenizer answering ``answer`` every turn, whose requests
    with images report the ids the model's processor makes of their whole text (each
    ``<image>`` expanded, as vLLM's processor does), and that processor."""
    import io

    from PIL import Image as PIL
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(vlm_dir)
    tok = proc.tokenizer

    def expand(ids: list[int], pngs: list[bytes]) -> list[int]:
        pil = [PIL.open(io.BytesIO(b)).convert("RGB") for b in pngs]
        text = "".join(tok.convert_ids_to_tokens(ids))
        return proc(text=text, images=[pil], add_special_tokens=False)["input_ids"][0]

    return FakeEngine(tok, policy=lambda ids: answer, expand=expand), proc


def _visual_runner(engine, n: int = 2, max_turns: int = 2):
    from asyncrl.actor.env_runner import MultiTurnEpisodes
    from asyncrl.actor.settings import ActorSettings
    from asyncrl.envs.settings import EnvSettings

    # max_tokens: 2 answers and a 67-token image (conf/env/visual_addition_mt.yaml)
    env = EnvSettings.from_config(
        {"_target_": "asyncrl.envs.visual.VisualRetryEnv", "max_turns": max_turns,
         "max_tokens": 80, "timeout_s": 60, "retries": 1, "retry_credit": 0.5}
    )  # fmt: skip
    settings = ActorSettings.defaults(
        sampling={"n": n, "max_tokens": 6}, engine={"max_model_len": 160}
    )
    return MultiTurnEpisodes(engine, default_task(), settings, env, lambda: 0)


def test_an_observation_image_is_appended_as_the_processors_tokens_exactly(vlm_dir, tmp_path):
    engine, proc = _processor_engine(vlm_dir, answer="99")  # always wrong: a retry
    prompt = default_task().sample(random.Random(3))
    group = asyncio.run(_visual_runner(engine).run_group(prompt))
    tok = proc.tokenizer
    image_id, eos = tok.convert_tokens_to_ids("<image>"), tok.eos_token_id
    answer = [*tok.encode("99", add_special_tokens=False), eos]
    for t in group.trajectories:
        assert t.finish_reason == "done" and t.error == "" and len(t.images) == 2
        assert t.images[0] == Image.of(prompt.meta["images"][0]) and t.images[1] != t.images[0]
        # the whole episode, prompt + response, is what the processor makes of its text
        pil = [PIL_of(im.png) for im in t.images]
        text = "<image>" + "99" + tok.eos_token + "<image>" + "99" + tok.eos_token
        want = proc(text=text, images=[pil], add_special_tokens=False)["input_ids"][0]
        assert t.prompt_ids.tolist() + t.response_ids.tolist() == want
        assert t.prompt_ids.size == IMAGE_IDS
        assert t.response_ids.size == 2 * len(answer) + IMAGE_IDS
        assert t.loss_mask.tolist() == [True] * 3 + [False] * IMAGE_IDS + [True] * 3
        assert (t.behaviour_logprobs[~t.loss_mask] == 0).all()
        assert t.reward == 0.0 and t.reward_breakdown["retries"] == 1.0
    # turn 1: the prompt's text and image; turn 2: one placeholder per image, both images
    assert engine.images[0] == prompt.meta["images"]
    assert engine.requests[2] == [image_id, *answer, image_id]
    assert engine.images[2] == [im.png for im in group.trajectories[0].images]
    # the samples share the prompt's Image; an observation's is stored once per key
    a, b = group.trajectories
    assert a.images[0] is b.images[0] and a.images[1] == b.images[1]
    back = from_bytes(to_bytes(group.trajectories))
    assert [im.key for im in back[0].images] == [im.key for im in a.images]
    # the log writes each image once; the inspector and the report show both, in order
    from asyncrl.tools.inspect_run import load_rows, token_table
    from asyncrl.tools.report import image_rows
    from asyncrl.utils.runlog import LogSettings, TrajectoryLog

    log = TrajectoryLog(LogSettings.defaults().spec(tmp_path))
    log.write(1, group.trajectories, 1)
    log.close()
    rows = load_rows(tmp_path)
    names = [f"images/{im.key}.png" for im in a.images]
    assert [r["images"] for r in rows] == [names] * 2
    assert len(list((tmp_path / "trajectories" / "images").iterdir())) == 2
    assert ", ".join(names) in token_table(rows[0])
    page = image_rows(tmp_path, rows)
    assert page.index(names[0]) < page.index(names[1]) and "99&lt;image&gt;99" in page


def test_a_placeholder_the_policy_writes_ends_its_episode_as_an_env_error(vlm_dir):
    engine, _ = _processor_engine(vlm_dir, answer="<image>")  # wrong, and a placeholder
    group = asyncio.run(_visual_runner(engine, n=1).run_group(default_task().sample(
        random.Random(4))))  # fmt: skip
    (t,) = group.trajectories
    assert t.finish_reason == "env_error" and "wrote an image placeholder" in t.error


def test_the_right_answer_ends_the_episode_with_the_prompts_image_alone(vlm_dir):
    prompt = default_task().sample(random.Random(5))
    engine, _ = _processor_engine(vlm_dir, answer=prompt.answer)
    group = asyncio.run(_visual_runner(engine, n=1).run_group(prompt))
    (t,) = group.trajectories
    assert t.reward == 1.0 and len(t.images) == 1 and t.loss_mask.all()


def PIL_of(png: bytes):  # noqa: N802 - reads as the image it returns
    import io

    from PIL import Image as PIL

    return PIL.open(io.BytesIO(png)).convert("RGB")


def test_the_packed_forward_puts_observation_images_in_their_tokens(vlm_dir):
    """Two-image episodes (the prompt's image and an observation's), packed with a
    prompt-image sequence: each sequence's log-probs are transformers' over it alone."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(vlm_dir)
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    rng, vis, tok = random.Random(7), default_task(), proc.tokenizer
    trajs, want = [], []
    for g in range(3):
        pngs = [vis.sample(rng).meta["images"][0] for _ in range(2 if g < 2 else 1)]
        images = [Image.of(b) for b in pngs]
        first, obs = "<image>", ["<image>"] if g < 2 else []
        text = first + "12" + tok.eos_token + "".join(o + "7" for o in obs)
        enc = proc(text=text, images=[[PIL_of(b) for b in pngs]], add_special_tokens=False,
                   return_tensors="pt")  # fmt: skip
        ids = enc["input_ids"][0].tolist()
        p = IMAGE_IDS
        resp = ids[p:]
        mask = np.ones(len(resp), bool)
        if obs:
            mask[3 : 3 + IMAGE_IDS] = False  # "12", EOS, then the observation's image
        n = len(resp)
        trajs.append(Trajectory(f"{g}", str(g), ids[:p], resp, np.zeros(n), np.zeros(n), mask,
                                0.0, images=images))  # fmt: skip
        with torch.no_grad():
            logits = model(**enc).logits[0, p - 1 : -1]
        want.append(torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(resp)])
    lm = load_lm(str(vlm_dir)).eval()
    policy = PolicyModel(lm)
    batch = collate(from_bytes(to_bytes(trajs)))
    pk = build_packed(batch, [[2, 0], [1]])
    assert [im.key for im in pk.images] == [im.key for i in pk.seqs for im in trajs[i].images]
    with torch.no_grad():
        px = policy.pixel_inputs(pk, torch.device("cpu"))
        logits, _ = policy_forward(lm, None, pk.input_ids, pk.position_ids, pk.flat_pos, px)
    got = token_logprobs(logits, pk.targets, 1.0, 0, 1.0)
    # 5 images: 3 prompts', 2 observations'
    assert int(px["image_tokens"].sum()) == 5 * IMAGE_TOKENS
    diff = (got - torch.cat([want[i] for i in pk.seqs])).abs().max().item()
    assert diff < FP32_LOGP_TOL
