"""The learner's module: an HF causal LM plus an optional value head.

The forward runs the decoder on packed rows and applies the LM head (and value head)
only at the positions that predict response tokens, so a large vocabulary costs
``N x V`` logits, not ``R x S x V``. :class:`PolicyModel` exists so FSDP has one root
module whose forward covers the decoder, the LM head and the value head; without FSDP
the same :func:`policy_forward` runs on the bare HF model.
"""

from __future__ import annotations

import torch
from torch import nn

# Names of the parameters of :class:`PolicyModel` that are not the HF model's.
LM_PREFIX = "lm."
VALUE_PREFIX = "value_head."


def policy_forward(
    lm: nn.Module,
    value_head: nn.Module | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    flat_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids``/``position_ids`` ``[R, S]``, ``flat_pos`` ``[N]`` -> logits ``[N, V]``
    and values ``[N]`` (fp32) or None. No attention mask: the restarting position ids
    make HF build the block-diagonal causal mask of packed sequences."""
    h = lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    h = h.last_hidden_state
    h = h.reshape(-1, h.shape[-1]).index_select(0, flat_pos)
    logits = lm.get_output_embeddings()(h)
    values = value_head(h).squeeze(-1).float() if value_head is not None else None
    return logits, values


class PolicyModel(nn.Module):
    def __init__(self, lm: nn.Module, value_head: bool = False):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1) if value_head else None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, flat_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return policy_forward(self.lm, self.value_head, input_ids, position_ids, flat_pos)


def load_lm(model_path: str, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    lm.train()
    return lm
