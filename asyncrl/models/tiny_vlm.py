"""Build the tiny vision-language model offline (``model=tiny_vlm``): an HF Idefics3
model (SmolVLM's architecture) whose language model is the tiny character model and
whose vision tower is a small seeded SigLIP-style encoder. Nothing is downloaded.

Why Idefics3: of the image-input architectures the pinned vLLM(-CPU) 0.32 registers,
LLaVA (its module imports Pixtral's image processor) and Qwen2-VL/2.5-VL/3-VL (theirs)
need torchvision, which asyncrl does not install; Idefics3 imports, runs on vLLM-CPU and
transformers with Pillow alone, and its processor is plain configuration (no image
splitting, one fixed square size), so the whole model is built here from code.

The parts:

- tokenizer: the tiny model's character tokenizer (:func:`asyncrl.models.tiny.build_tokenizer`)
  plus Idefics3's image tokens (:data:`IMAGE_TOKENS`), each one token. One image in a
  prompt (the text ``<image>``) becomes ``<fake_token_around_image><global-img>``,
  ``image_seq_len`` x ``<image>`` and ``<fake_token_around_image>``.
- language model: a Llama decoder (the one Idefics3 takes) holding the tiny Qwen2
  model's weights: Llama with ``attention_bias`` is Qwen2 plus an output-projection
  bias, set to zero. Its vocabulary grows by the image tokens (new rows seeded).
- vision tower: ``image_size``/``patch_size`` squared patches through
  ``vision_layers`` encoder layers; the connector's pixel shuffle folds each
  ``scale_factor`` x ``scale_factor`` block into one token: ``image_seq_len`` =
  (image_size / patch_size / scale_factor)^2 tokens per image.
- warm start (:func:`warm_start`): supervised steps on the task's rendered prompts in
  two phases: the tower and connector alone on a per-image-token reading loss (each
  token names the characters drawn in its region), then every weight on the answer
  (and EOS) plus the reading loss. Off by default: no recipe tried yet makes the tower
  read well enough for the answer (docs/vision.md, Warm start).

``python -m asyncrl.models.tiny_vlm`` builds the default one into the cache (or
``--rebuild DIR``) and prints its directory and weights' sha256; the cache key is a hash
of every setting, the build is under a file lock, the sha256 is in
``asyncrl_build.json``. Like the tiny model, a build follows the CPU's floating-point
path: another CPU may build other bytes (docs/vision.md).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from asyncrl.config import ConfigError, Settings, defaults, setting, settings_from
from asyncrl.models.tiny import (
    TinyModelSpec,
    build_tokenizer,
    default_cache_dir,
    ensure_tiny_model,
)
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.visual import IMAGE_PLACEHOLDER, VisualAdditionTask, prompt_images

FAKE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<global-img>"
# Idefics3's processor looks these up by name; <end_of_utterance> ends a chat turn
IMAGE_TOKENS = (FAKE_TOKEN, IMAGE_PLACEHOLDER, "<end_of_utterance>", GLOBAL_TOKEN)
PIXEL_MEAN = PIXEL_STD = (0.5, 0.5, 0.5)  # SigLIP's normalisation: pixels to [-1, 1]
PROGRESS_EVERY_S = 30.0  # a long build says where it is this often (stderr)


@dataclass
class TinyVLMSpec(Settings):
    """``model.vlm`` in config; conf/model/tiny_vlm.yaml holds every value."""

    KEY: ClassVar[str] = "model.vlm"
    PRESET: ClassVar[tuple[str, ...]] = ("model=tiny_vlm",)

    image_size: int = setting("[16, 1024]")  # the tower's square input; images are resized to it
    patch_size: int = setting("[2, 64]")
    scale_factor: int = setting("[1, 8]")  # pixel shuffle: scale_factor^2 patches per token
    vision_hidden_size: int = setting("[32, 4096]")
    vision_layers: int = setting("[1, 48]")
    vision_heads: int = setting("[1, 64]")
    vision_intermediate_size: int = setting("[1, 16384]")
    max_positions: int = setting("[16, 65536]")  # the language model's
    seed: int = setting(">= 0")
    warm_start_read_steps: int = setting("[0, 100000]")  # the tower and connector alone
    warm_start_steps: int = setting("[0, 100000]")  # every weight: answer + reading loss
    warm_start_read_weight: float = setting("[0, 100]")
    warm_start_batch: int = setting("[1, 4096]")
    warm_start_lr: float = setting("(0, 1]")

    def check(self) -> None:
        super().check()
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ConfigError(
                f"model.vlm.image_size={self.image_size}: must be a multiple of patch_size x "
                f"scale_factor ({self.patch_size} x {self.scale_factor}): the pixel shuffle "
                "folds whole blocks of patches"
            )
        if self.vision_hidden_size % self.vision_heads:
            raise ConfigError(
                f"model.vlm.vision_heads={self.vision_heads}: must divide vision_hidden_size "
                f"({self.vision_hidden_size})"
            )

    @property
    def image_seq_len(self) -> int:
        """``<image>`` tokens per image."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2


def build_vlm_tokenizer(alphabet: str):
    """The tiny model's character tokenizer with the image tokens added (each one id,
    after the characters': the tiny model's ids are unchanged)."""
    tok = build_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    return tok


def build_processor(tokenizer, spec: TinyVLMSpec):
    """Idefics3's processor: no image splitting, every image resized to ``image_size``
    square, one image = ``image_seq_len`` tokens."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    images = Idefics3ImageProcessorPil(
        do_resize=False,  # the no-split path resizes to max_image_size itself
        do_image_splitting=False,
        max_image_size={"longest_edge": spec.image_size},
        size={"longest_edge": spec.image_size},
        image_mean=list(PIXEL_MEAN),
        image_std=list(PIXEL_STD),
        do_pad=True,  # also returns the pixel_attention_mask both vLLM and HF read
    )
    return Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=spec.image_seq_len
    )


def build_model(spec: TinyVLMSpec, lm_dir: Path, tokenizer):
    """A seeded Idefics3ForConditionalGeneration whose decoder holds the tiny model's
    weights (``lm_dir``, a Qwen2ForCausalLM with a tied head), fp32."""
    from transformers import (
        AutoConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    lm = AutoConfig.from_pretrained(lm_dir)
    if lm.model_type != "qwen2" or not lm.tie_word_embeddings:
        raise ValueError(f"{lm_dir}: expected the tiny Qwen2 model with tied embeddings")
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=lm.hidden_size,
        intermediate_size=lm.intermediate_size,
        num_hidden_layers=lm.num_hidden_layers,
        num_attention_heads=lm.num_attention_heads,
        num_key_value_heads=lm.num_key_value_heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=lm.rms_norm_eps,
        rope_parameters=dict(lm.rope_parameters),
        attention_bias=True,  # Qwen2's q/k/v biases (and an o_proj bias, zeroed below)
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = Idefics3VisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        num_channels=3,
    )
    cfg = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER),
        scale_factor=spec.scale_factor,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Idefics3ForConditionalGeneration(cfg)
    copy_tiny_weights(model.model.text_model, lm_dir)
    return model


def copy_tiny_weights(decoder, lm_dir: Path) -> None:
    """The tiny Qwen2 model's weights into the Llama ``decoder`` (its embedding's first
    rows: the characters'; the o_proj biases Qwen2 lacks set to zero)."""
    from safetensors.torch import load_file

    weights = load_file(str(lm_dir / "model.safetensors"))
    with torch.no_grad():
        embed = weights.pop("model.embed_tokens.weight")
        decoder.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        for name, w in weights.items():
            if name.startswith("model."):
                decoder.get_parameter(name.removeprefix("model.")).copy_(w)
        for layer in decoder.layers:
            layer.self_attn.o_proj.bias.zero_()


def batch_of(prompts: list, processor, tokenizer) -> dict[str, torch.Tensor]:
    """Model inputs and labels of demonstrations: each prompt (its image placeholder
    expanded by the processor), then its answer and EOS, right-padded; labels only on
    the answer and EOS."""
    enc = processor(
        text=[p.text for p in prompts],
        images=[prompt_images(p) for p in prompts],
        return_tensors="pt",
    )
    rows, masks = [], []
    for p, ids in zip(prompts, enc["input_ids"].tolist(), strict=True):
        answer = tokenizer(p.answer, add_special_tokens=False)["input_ids"]
        answer += [tokenizer.eos_token_id]
        rows.append(ids + answer)
        masks.append([0] * len(ids) + [1] * len(answer))
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
        labels[i, : len(r)] = torch.tensor([t if k else -100 for t, k in zip(r, m)])
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "labels": labels,
        "pixel_values": enc["pixel_values"],
        "pixel_attention_mask": enc["pixel_attention_mask"],
    }


def reading_classes(tokenizer, task: VisualAdditionTask) -> list[int]:
    """The reading loss's classes, as token ids: blank (the pad token) and then each
    character of the task's alphabet."""
    return [tokenizer.pad_token_id, *tokenizer.convert_tokens_to_ids(list(task.alphabet))]


def reading_targets(
    shown: list[str], centres: list[list[tuple[float, float]]], task: VisualAdditionTask,
    spec: TinyVLMSpec,
) -> torch.Tensor:  # fmt: skip
    """(batch, image_seq_len, classes) target distributions of the reading loss: image
    token k (raster order over a square grid of regions of the image) should read the
    characters whose centres the renderer put in its region, in equal shares, or blank
    (class 0) where there are none."""
    side = math.isqrt(spec.image_seq_len)
    region = task.image_size / side
    out = torch.zeros(len(shown), spec.image_seq_len, 1 + len(task.alphabet))
    for i, (text, cs) in enumerate(zip(shown, centres, strict=True)):
        for ch, (x, y) in zip(text, cs, strict=True):
            row, col = (min(side - 1, max(0, int(v // region))) for v in (y, x))
            out[i, row * side + col, 1 + task.alphabet.index(ch)] += 1.0
    out[..., 0][out.sum(-1) == 0] = 1.0
    return out / out.sum(-1, keepdim=True)


def reading_loss(model, batch: dict[str, torch.Tensor], targets, classes: list[int]):
    """Cross-entropy of each image token's connector output, read through the language
    model's input embedding (logits = features @ E[classes]^T), against ``targets``:
    the mean over the tokens with ink and the mean over the blank ones, weighted
    equally. Blank tokens outnumber the others (about 4 to 1 on a 4 x 4 grid, 14 to 1 on
    8 x 8): under a plain mean a tower that reads blank everywhere scores well."""
    feats = model.model.get_image_features(
        pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"]
    ).pooler_output.reshape(targets.shape[0], targets.shape[1], -1)
    table = model.model.text_model.embed_tokens.weight[classes]
    ce = -(targets * torch.log_softmax(feats @ table.T, dim=-1)).sum(-1)
    blank = targets[..., 0] == 1.0
    parts = [ce[m].sum() / m.sum().clamp(min=1) for m in (~blank, blank)]
    return 0.5 * (parts[0] + parts[1])


def warm_start(
    model, processor, tokenizer, task: VisualAdditionTask, spec: TinyVLMSpec
) -> dict[str, list[float]]:
    """Two phases of AdamW steps on freshly rendered demonstrations:
    ``warm_start_read_steps`` on the reading loss (:func:`reading_loss`) with only the
    vision tower and connector trained (the language model and its embedding fixed), then
    ``warm_start_steps`` on the answer loss (the answer and EOS) plus
    ``warm_start_read_weight`` x the reading loss, every weight trained. Each phase's
    learning rate rises linearly over ``WARMUP_STEPS`` to ``warm_start_lr`` and then
    follows a cosine to 0. Returns each phase's losses per step (the reading loss of the
    first, the answer loss of the second)."""
    rng = random.Random(spec.seed + 1)
    classes = reading_classes(tokenizer, task)
    tower = [*model.model.vision_model.parameters(), *model.model.connector.parameters()]
    losses: dict[str, list[float]] = {"read": [], "answer": []}
    phases = (("read", spec.warm_start_read_steps, tower),
              ("answer", spec.warm_start_steps, list(model.parameters())))  # fmt: skip
    t0 = last = time.time()
    for phase, steps, params in phases:
        if not steps:
            continue
        trained = {id(p) for p in params}
        for p in model.parameters():  # no gradient where nothing is trained
            p.requires_grad_(id(p) in trained)
        opt = torch.optim.AdamW(params, lr=spec.warm_start_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s, n=steps: lr_factor(s, n))
        model.train()
        for step in range(steps):
            drawn = [task.sample_with_centres(rng) for _ in range(spec.warm_start_batch)]
            loss, logged = warm_start_loss(
                model, drawn, processor, tokenizer, task, spec, classes, phase
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses[phase].append(logged)
            now = time.time()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                recent = losses[phase][-20:]
                print(
                    f"asyncrl: building tiny_vlm: warm start, {phase} step {step + 1}/{steps}, "
                    f"loss {sum(recent) / len(recent):.3f}, {now - t0:.0f} s",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return losses


def warm_start_loss(
    model, drawn: list, processor, tokenizer, task: VisualAdditionTask, spec: TinyVLMSpec,
    classes: list[int], phase: str,
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """One warm-start step's loss on ``drawn`` ((prompt, character centres) pairs) and
    the figure logged for it: in phase ``"read"`` the reading loss (both); in phase
    ``"answer"`` the answer loss plus ``warm_start_read_weight`` x the reading loss, and
    the answer loss."""
    prompts = [p for p, _ in drawn]
    batch = batch_of(prompts, processor, tokenizer)
    targets = reading_targets([p.meta["shown"] for p in prompts], [c for _, c in drawn], task, spec)
    read = reading_loss(model, batch, targets, classes)
    if phase == "read":
        return read, read.item()
    answer = model(**batch).loss
    return answer + spec.warm_start_read_weight * read, answer.item()


WARMUP_STEPS = 20  # each warm-start phase's linear learning-rate warm-up


def lr_factor(step: int, steps: int) -> float:
    """The learning rate's factor at ``step`` of ``steps``: a linear warm-up over
    :data:`WARMUP_STEPS`, then a cosine to 0."""
    return min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1.0 + math.cos(math.pi * step / steps))


EVAL_PROMPTS = 256  # the fixed held-out split the build's accuracy is measured on
EVAL_SEED = 10**6  # its sampler's seed: far from every warm-start and run seed


@torch.no_grad()
def greedy_accuracy(
    model, processor, tokenizer, task: VisualAdditionTask, n: int = EVAL_PROMPTS,
    seed: int = EVAL_SEED, batch: int = 64,
) -> float:  # fmt: skip
    """Share of ``n`` held-out prompts (drawn with ``seed``) whose greedy answer is the
    exact sum (the task's reward), answers cut at EOS or ``max_response_chars`` + 1."""
    rng = random.Random(seed)
    prompts = [task.sample(rng) for _ in range(n)]
    model.eval()
    right = 0.0
    for i in range(0, n, batch):
        chunk = prompts[i : i + batch]
        enc = processor(
            text=[p.text for p in chunk], images=[prompt_images(p) for p in chunk],
            return_tensors="pt",
        )  # fmt: skip
        ids = enc["input_ids"]
        for _ in range(task.max_response_chars + 1):
            logits = model(
                input_ids=ids, pixel_values=enc["pixel_values"],
                pixel_attention_mask=enc["pixel_attention_mask"],
            ).logits[:, -1]  # fmt: skip
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        width = enc["input_ids"].shape[1]
        for p, row in zip(chunk, ids[:, width:].tolist(), strict=True):
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            right += task.reward(p, tokenizer.decode(row))["exact"]
    return right / n


@torch.no_grad()
def reading_accuracy(
    model, processor, tokenizer, task: VisualAdditionTask, spec: TinyVLMSpec,
    n: int = EVAL_PROMPTS, seed: int = EVAL_SEED, batch: int = 64,
) -> float:  # fmt: skip
    """Share of the held-out split's image tokens with ink (a character centre in their
    region) whose reading (:func:`reading_loss`'s logits) has its argmax among the
    characters of :func:`reading_targets`."""
    rng = random.Random(seed)
    drawn = [task.sample_with_centres(rng) for _ in range(n)]
    classes = reading_classes(tokenizer, task)
    table = model.model.text_model.embed_tokens.weight[classes]
    model.eval()
    right = inked = 0
    for i in range(0, n, batch):
        chunk = drawn[i : i + batch]
        enc = processor(
            text=[p.text for p, _ in chunk], images=[prompt_images(p) for p, _ in chunk],
            return_tensors="pt",
        )  # fmt: skip
        feats = model.model.get_image_features(
            pixel_values=enc["pixel_values"], pixel_attention_mask=enc["pixel_attention_mask"]
        ).pooler_output.reshape(len(chunk), spec.image_seq_len, -1)
        targets = reading_targets(
            [p.meta["shown"] for p, _ in chunk], [c for _, c in chunk], task, spec
        )
        guess = (feats @ table.T).argmax(-1, keepdim=True)
        ink = targets[..., 0] == 0
        hit = targets.gather(-1, guess)[..., 0] > 0
        right += int((hit & ink).sum())
        inked += int(ink.sum())
    return right / max(1, inked)


def text_task(task: VisualAdditionTask) -> AdditionTask:
    """The text task the language model was warm-started on: the same sums, in characters."""
    return AdditionTask(max_operand=task.max_operand, num_operands=task.num_operands)


def build_tiny_vlm(
    out_dir: Path, task: VisualAdditionTask, spec: TinyVLMSpec, lm_spec: TinyModelSpec,
    cache_dir: Path | None = None, measure: bool = True,
) -> Path:  # fmt: skip
    """Build into ``out_dir`` (atomically: a reader never sees half a model); with
    ``measure``, the greedy accuracy on the held-out split (:func:`greedy_accuracy`)
    before and after the warm start goes into ``asyncrl_build.json``."""
    from asyncrl.utils.fingerprint import weights_sha256

    lm_dir = ensure_tiny_model(text_task(task), lm_spec, cache_dir)
    tokenizer = build_vlm_tokenizer(task.alphabet)
    processor = build_processor(tokenizer, spec)
    model = build_model(spec, lm_dir, tokenizer)
    accuracy = {}
    if measure:
        accuracy["greedy_accuracy_before"] = greedy_accuracy(model, processor, tokenizer, task)
    t0 = time.time()
    c0 = time.process_time()
    losses = warm_start(model, processor, tokenizer, task, spec)
    seconds, cpu_seconds = round(time.time() - t0, 2), round(time.process_time() - c0, 2)
    reads, answers = losses["read"], losses["answer"]
    if measure:
        accuracy["greedy_accuracy_after"] = greedy_accuracy(model, processor, tokenizer, task)
        accuracy["reading_accuracy_after"] = reading_accuracy(
            model, processor, tokenizer, task, spec
        )
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)  # the tokenizer's files and processor_config.json
    meta = {
        "spec": asdict(spec),
        "lm_spec": asdict(lm_spec),
        "lm_weights_sha256": weights_sha256(lm_dir),
        "task": task_key(task),
        "cache_key": cache_key(task, spec, lm_spec),
        "params": sum(p.numel() for p in model.parameters()),
        "warm_start_read_loss_first": reads[0] if reads else None,
        "warm_start_read_loss_last": reads[-1] if reads else None,
        "warm_start_loss_first": answers[0] if answers else None,
        "warm_start_loss_last": answers[-1] if answers else None,
        "warm_start_seconds": seconds,
        "warm_start_cpu_seconds": cpu_seconds,
        **accuracy,
        "eval_prompts": EVAL_PROMPTS,
        "eval_seed": EVAL_SEED,
        "torch": torch.__version__,
        "weights_sha256": weights_sha256(tmp),
    }
    (tmp / "asyncrl_build.json").write_text(json.dumps(meta, indent=2))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another builder finished first: theirs is complete, keep it
        if not (out_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def task_key(task: VisualAdditionTask) -> str:
    """The task's class and its plain settings (tuples as lists)."""
    attrs = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in sorted(vars(task).items())
        if isinstance(v, int | float | str | bool | tuple)
    }
    return f"{type(task).__module__}.{type(task).__qualname__}{json.dumps(attrs)}"


def cache_key(task: VisualAdditionTask, spec: TinyVLMSpec, lm_spec: TinyModelSpec) -> str:
    """12 hex digits naming the model of (task, spec, lm_spec) in the cache."""
    blob = json.dumps([asdict(spec), asdict(lm_spec), task_key(task)])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tiny_vlm(
    task: VisualAdditionTask, spec: TinyVLMSpec, lm_spec: TinyModelSpec,
    cache_dir: Path | None = None,
) -> Path:  # fmt: skip
    """Path to the cached tiny VLM for (task, spec, lm_spec). The default one is copied
    from the package (:data:`asyncrl.models.shipped.TINY_VLM`, its weights' sha256
    checked on every call); any other is built once if missing (two processes asking at
    once build it once: file lock)."""
    from asyncrl.models.shipped import TINY_VLM

    cache_dir = Path(cache_dir or default_cache_dir())
    key = cache_key(task, spec, lm_spec)
    out = cache_dir / f"tiny_vlm-{key}"
    is_shipped = key == TINY_VLM.cache_key

    def ready() -> bool:
        return TINY_VLM.is_current(out) if is_shipped else (out / "config.json").exists()

    if ready():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir / f".tiny_vlm-{key}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        try:
            if ready():
                return out
            if is_shipped:
                return TINY_VLM.install(out)
            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
            build_tiny_vlm(out, task, spec, lm_spec, cache_dir)
        finally:
            lock_path.unlink(missing_ok=True)
    return out


def default_task(**overrides: Any) -> VisualAdditionTask:
    """``task=visual_addition``'s task (conf/task/visual_addition.yaml), with ``overrides``."""
    conf = defaults("task", ["task=visual_addition"])
    conf.pop("_target_")
    return VisualAdditionTask(**{**conf, **overrides})


def default_lm_spec() -> TinyModelSpec:
    """``model=tiny_vlm``'s language model spec (its ``model.tiny``)."""
    return settings_from(TinyModelSpec, defaults("model.tiny", TinyVLMSpec.PRESET), "model.tiny")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the tiny vision-language model offline.")
    ap.add_argument("--out", type=Path, default=None, help="cache dir (default $ASYNCRL_CACHE)")
    ap.add_argument("--warm-start-steps", type=int, default=None, help="default: model.vlm's")
    ap.add_argument("--warm-start-read-steps", type=int, default=None, help="default: model.vlm's")
    ap.add_argument("--rebuild", type=Path, default=None, metavar="DIR",
                    help="build from scratch into DIR")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any model.vlm setting, e.g. --set scale_factor=1")  # fmt: skip
    args = ap.parse_args(argv)
    overrides = {
        k: v
        for k, v in (("warm_start_steps", args.warm_start_steps),
                     ("warm_start_read_steps", args.warm_start_read_steps))
        if v is not None
    }  # fmt: skip
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    spec = TinyVLMSpec.defaults(**overrides)
    task, lm_spec = default_task(), default_lm_spec()
    if args.rebuild is not None:
        out = build_tiny_vlm(args.rebuild, task, spec, lm_spec, args.out)
    else:
        out = ensure_tiny_vlm(task, spec, lm_spec, args.out)
    meta = json.loads((out / "asyncrl_build.json").read_text())
    print(out, meta["weights_sha256"])


if __name__ == "__main__":
    main()
