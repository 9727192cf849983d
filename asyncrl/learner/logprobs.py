"""Per-token log-probs of the sampled response tokens under the learner's model.

They must be log-probs of the same distribution vLLM sampled from, i.e. vLLM's
``processed_logprobs``: logits divided by the temperature, then top-k / top-p
filtering (filtered tokens get -inf), then log-softmax.
"""

from __future__ import annotations

import torch

from asyncrl.learner.batch import TrainBatch


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """``[..., V]`` logits -> log-probs of the sampling distribution."""
    if temperature <= 0:
        raise ValueError(
            "greedy sampling (temperature 0) has no log-probs to correct with; use temperature > 0"
        )
    logits = logits.float() / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def response_logprobs(
    model: torch.nn.Module,
    mb: TrainBatch,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    return_hidden: bool = False,
):
    """``[B, T]`` log-probs of ``mb.response_ids`` (0 at padding); with ``return_hidden``
    also the final hidden state at the positions that predict each response token
    (``[B, T, H]``, for a value head)."""
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        output_hidden_states=return_hidden,
        use_cache=False,
    )
    B, T = mb.response_ids.shape
    # logits at position p predict token p+1: response token j sits at resp_start+j.
    pos = (mb.resp_start[:, None] + torch.arange(T)[None, :] - 1).clamp(
        min=0, max=mb.input_ids.shape[1] - 1
    )
    logits = out.logits.gather(1, pos[:, :, None].expand(B, T, out.logits.shape[-1]))
    logp = process_logits(logits, temperature, top_k, top_p)
    tok = logp.gather(-1, mb.response_ids[:, :, None]).squeeze(-1)
    valid = torch.arange(T)[None, :] < mb.resp_len[:, None]
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    if not return_hidden:
        return tok
    h = out.hidden_states[-1]
    return tok, h.gather(1, pos[:, :, None].expand(B, T, h.shape[-1]))


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """``[N, V]`` logits, ``[N]`` token ids -> ``[N]`` fp32 log-probs under the sampling
    distribution."""
    logp = process_logits(logits, temperature, top_k, top_p)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


def to_rows(x: torch.Tensor, seq: torch.Tensor, tok: torch.Tensor, shape: tuple[int, int]):
    """Scatter ``[N]`` per-token values into a zero ``[B, T]`` response layout
    (differentiable)."""
    out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    return out.index_put((seq, tok), x)
