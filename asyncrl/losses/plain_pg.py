"""Plain policy gradient: no off-policy correction at all.

Per valid token ``t`` of sequence ``b``::

    loss = sum_{b,t} w[b,t] * -(A[b,t] * logp[b,t])

The behaviour log-probs are ignored, so a stale sample is trained on as if the
current policy had drawn it. This is the "no correction" baseline of
``benchmarks/staleness.py``; on-policy it equals every built-in correction.
"""

from __future__ import annotations

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics


class PlainPGLoss:
    """REINFORCE with the learner's advantages. Metrics: ``is/*`` (diagnostics only:
    they show how off-policy the data was, nothing here acts on them)."""

    needs_proximal = False
    needs_values = False

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        per_token = -batch.advantages.to(outputs.logprobs.dtype) * outputs.logprobs
        return LossOutput(
            loss=weighted_sum(per_token, batch), metrics=is_diagnostics(batch, outputs)
        )
