"""The driver's start-up check of ``learner.ep`` against the model (no torch imported)."""

from __future__ import annotations

from asyncrl.config import ConfigError


def num_experts(config: object) -> int:
    """Routed experts per MoE layer of an HF config (Qwen-MoE ``num_experts``, Mixtral
    ``num_local_experts``); 0 for a dense model."""
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def check_model(
    model_dir: str, ep: int, routing_replay: bool = False, record_experts: bool = False
) -> None:
    """Before Ray: with ``learner.ep > 1``, ``learner.moe.routing_replay`` or
    ``actor.record_experts``, ``model_dir`` has experts (and ``ep`` divides their
    number); else one ConfigError naming the key."""
    if ep == 1 and not routing_replay and not record_experts:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    n = num_experts(config)
    if n == 0 and ep == 1:
        key = "learner.moe.routing_replay" if routing_replay else "actor.record_experts"
        raise ConfigError(
            f"{key}=true: model {model_dir} ({config.model_type}) is "
            f"dense (no experts to route); set it false"
        )
    if n == 0:
        raise ConfigError(
            f"learner.ep={ep}: model {model_dir} ({config.model_type}) is dense (no experts); "
            f"set learner.ep=1"
        )
    if n % ep:
        raise ConfigError(
            f"learner.ep={ep} does not divide the model's num_experts={n} ({model_dir}); "
            f"pick a divisor of {n}"
        )
