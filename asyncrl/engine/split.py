"""What vLLM's tensor parallelism needs of a model, checked in the driver before Ray
(``actor.engine.tensor_parallel_size``): read from the model directory's config.json,
no transformers, no vLLM.

vLLM splits attention by whole heads (``ModelConfig.verify_with_parallel_config``:
heads divisible by the TP size), key/value heads either split (divisible) or
replicated (the TP size a multiple of them: ``QKVParallelLinear``'s
``num_kv_head_replicas``), and every column- or row-parallel width into equal parts
(``divide`` in vllm/model_executor/layers/linear.py: the MLP's, the experts').
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError

KEY = "actor.engine.tensor_parallel_size"
WIDTHS = ("intermediate_size", "moe_intermediate_size")  # split into equal parts


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of an HF config (a multi-modal model nests it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def indivisible(config: dict[str, Any], tp: int) -> list[str]:
    """The sizes of ``config`` (an HF config.json's mapping) that vLLM cannot split
    ``tp`` ways, as phrases ("4 attention heads")."""
    c = text_config(config)
    bad = []
    heads = c.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        bad.append(f"{heads} attention heads")
    kv = c.get("num_key_value_heads", heads)
    if isinstance(kv, int) and kv % tp and tp % kv:
        bad.append(f"{kv} key/value heads (neither divisible by {tp} nor dividing it)")
    for name in WIDTHS:
        width = c.get(name)
        if isinstance(width, int) and width and width % tp:
            bad.append(f"{name} {width}")
    return bad


def check_model(model_dir: str, tp: int) -> None:
    """In the driver, before Ray: vLLM can split ``model_dir`` ``tp`` ways, or one
    ConfigError naming the key and the sizes that are not divisible."""
    if tp == 1:
        return
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}={tp}: cannot read {path}: {e}") from None
    bad = indivisible(config, tp)
    if bad:
        kind = text_config(config).get("model_type", config.get("model_type", "?"))
        raise ConfigError(
            f"{KEY}={tp}: model {model_dir} ({kind}) has {', '.join(bad)}, not divisible "
            f"by {tp}; lower {KEY}"
        )
