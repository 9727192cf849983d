"""Tensor parallelism inside each decoder layer (``learner.tp``), by torch DTensor.

    ranks 0 .. world_size-1 ─▶ mesh ("dp", "tp"), rank = dp_rank * tp + tp_rank
      per decoder layer: parallelize_module(layer, mesh["tp"], the family's plan)
        attention q/k/v, MLP gate/up: ColwiseParallel  (output features split: local heads)
        attention o, MLP down:        RowwiseParallel  (input features split; all-reduce out)
        per-head q/k norms:           SequenceParallel on the heads dimension (weight
                                      replicated; its gradient, partial per rank, summed)
      then FSDP2 fully_shard over mesh["dp"] (learner/dist.py: ``shard``)

The plan is the model family's own: the ``layers.*.`` entries of the HF config's
``base_model_tp_plan`` (Llama, Qwen2, Mistral, Qwen3-MoE, ...). ``colwise`` / ``rowwise``
map to torch's ``ColwiseParallel`` / ``RowwiseParallel``; ``replicated_with_grad_allreduce``
(Qwen3's per-head ``q_norm`` / ``k_norm``, which see only this rank's heads) to torch's
``SequenceParallel`` over the heads dimension: the weight is a replicated DTensor and the
input is marked sharded on heads, so the weight's gradient comes out partial and FSDP
sums it over ``tp`` before its own reduction. A MoE layer's experts are never split by
``tp``: with ``learner.ep`` their plan entries are dropped (learner/expert_parallel.py
splits them over ``ep``), without it a MoE model is refused. Everything outside the
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
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")  # the plan styles built here
EXPERTS_PATH = "mlp.experts"  # a MoE layer's experts: split by learner.ep, never by tp
NORM_HEADS_DIM = 2  # a per-head norm's input is [rows, positions, heads, head_dim]


def layer_plan(config: Any, ep: int = 1) -> dict[str, str]:
    """``{module path inside a decoder layer: style}`` (a style of :data:`STYLES`) from the
    HF config's ``base_model_tp_plan``; with ``ep > 1`` without the experts' entries
    (expert parallelism splits them). ValueError naming the model when it has none, or
    uses a style not built here."""
    name = f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')})"
    full = getattr(config, "base_model_tp_plan", None) or {}
    plan = {k[len(LAYER_PREFIX) :]: v for k, v in full.items() if k.startswith(LAYER_PREFIX)}
    if ep > 1:
        plan = {k: v for k, v in plan.items() if not k.startswith(EXPERTS_PATH)}
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


def check_model(model_dir: str, tp: int, ep: int = 1) -> None:
    """In the driver, before Ray: ``model_dir`` can be split ``tp`` ways (a plan, whole
    heads per rank; a MoE model's experts split by ``learner.ep`` instead), or one
    ConfigError naming ``learner.tp`` and the model."""
    if tp == 1:
        return
    from transformers import AutoConfig

    from asyncrl.learner.moe_check import num_experts

    config = AutoConfig.from_pretrained(model_dir)
    if num_experts(config) and ep == 1:
        raise ConfigError(
            f"learner.tp={tp}: model {model_dir} ({config.model_type}) has experts, which "
            f"tensor parallelism does not split; set learner.ep to a multiple of {tp}"
        )
    try:
        layer_plan(config, ep)
    except ValueError as e:
        raise ConfigError(f"learner.tp={tp}: model {model_dir}: {e}") from None
    bad = divisibility(config, tp)
    if bad:
        raise ConfigError(
            f"learner.tp={tp}: model {model_dir} ({config.model_type}) has {', '.join(bad)}, "
            f"not divisible by {tp}; lower learner.tp"
        )


def parallelize_layers(layers: nn.ModuleList, config: Any, tp_mesh: Any, ep: int = 1) -> None:
    """Split every decoder layer over ``tp_mesh`` by the family's plan (its entries for
    modules the layer has: a MoE layer has no dense MLP, a dense one no experts)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "replicated_with_grad_allreduce": lambda: SequenceParallel(
            sequence_dim=NORM_HEADS_DIM, use_local_output=True
        ),
    }
    plan = layer_plan(config, ep)
    for layer in layers:
        here = {n for n, _ in layer.named_modules()}
        parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in plan.items() if k in here})
