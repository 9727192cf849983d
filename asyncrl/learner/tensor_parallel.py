"""Tensor parallelism inside each decoder layer (``learner.tp``), by torch DTensor.

    ranks 0 .. world_size-1 ─▶ mesh ("dp", "tp"), rank = dp_rank * tp + tp_rank
      per decoder layer: parallelize_module(layer, mesh["tp"], the family's plan)
        attention q/k/v, MLP gate/up: ColwiseParallel  (output features split: local heads)
        attention o, MLP down:        RowwiseParallel  (input features split; all-reduce out)
      then FSDP2 fully_shard over mesh["dp"] (learner/dist.py: ``shard``)

The plan is the model family's own: the ``layers.*.`` entries of the HF config's
``base_model_tp_plan`` (Llama, Qwen2, Mistral, ...), whose ``colwise`` / ``rowwise``
styles map to torch's ``ColwiseParallel`` / ``RowwiseParallel``. Everything outside the
decoder layers (embeddings, norms, LM head, value head) is replicated over ``tp`` and
sharded by FSDP over ``dp`` only: the hidden state between layers is whole on every
rank of a ``tp`` group (no sequence parallelism, no vocabulary-parallel loss). HF's
attention reshapes with ``view(..., -1, head_dim)``, so a layer whose projections
return local shards runs on its ``heads / tp`` local heads with no change to the model.

The ``tp`` ranks of one data-parallel group train on the same rows: they compute the
same loss, and the gradients of replicated parameters come out equal on each of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.config import ConfigError

if TYPE_CHECKING:  # the driver's start-up check imports this module without torch
    from torch import nn

LAYER_PREFIX = "layers.*."  # base_model_tp_plan keys of one decoder layer's modules
STYLES = ("colwise", "rowwise")  # the plan styles built here


def layer_plan(config: Any) -> dict[str, str]:
    """``{module path inside a decoder layer: "colwise" | "rowwise"}`` from the HF config's
    ``base_model_tp_plan``. ValueError naming the model when it has none, or uses a style
    not built here."""
    name = f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')})"
    full = getattr(config, "base_model_tp_plan", None) or {}
    plan = {k[len(LAYER_PREFIX) :]: v for k, v in full.items() if k.startswith(LAYER_PREFIX)}
    if not plan:
        raise ValueError(f"{name} has no tensor-parallel plan for its decoder layers")
    odd = sorted({v for v in plan.values() if v not in STYLES})
    if odd:
        raise ValueError(f"{name}: its tensor-parallel plan uses {odd}; built here: {STYLES}")
    return plan


def divisibility(config: Any, tp: int) -> list[str]:
    """The sizes a ``tp``-way split needs whole that ``config`` has not divisible by ``tp``
    (as ``name=value``): attention heads, key/value heads, MLP width."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    return [f"{k}={v}" for k, v in sizes.items() if v % tp]


def check_model(model_dir: str, tp: int) -> None:
    """In the driver, before Ray: ``model_dir`` can be split ``tp`` ways (a plan, whole
    heads per rank), or one ConfigError naming ``learner.tp`` and the model."""
    if tp == 1:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    try:
        layer_plan(config)
    except ValueError as e:
        raise ConfigError(f"learner.tp={tp}: model {model_dir}: {e}") from None
    bad = divisibility(config, tp)
    if bad:
        raise ConfigError(
            f"learner.tp={tp}: model {model_dir} ({config.model_type}) has {', '.join(bad)}, "
            f"not divisible by {tp}; lower learner.tp"
        )


def parallelize_layers(layers: nn.ModuleList, config: Any, tp_mesh: Any) -> None:
    """Split every decoder layer's linear layers over ``tp_mesh`` by the family's plan."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = layer_plan(config)
    for layer in layers:
        parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in plan.items()})
