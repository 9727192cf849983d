"""V-trace (Espeholt et al. 2018, IMPALA, section 4) and a loss built on it.

For one trajectory with valid steps ``0..L-1`` and ``V(x_L) = bootstrap_value``::

    rho_t   = min(rho_bar, pi_t / mu_t)
    c_t     = lam * min(c_bar, pi_t / mu_t)
    delta_t = rho_t * (r_t + gamma * V(x_{t+1}) - V(x_t))
    v_s     = V(x_s) + sum_{t=s}^{L-1} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t
            = V(x_s) + delta_s + gamma * c_s * (v_{s+1} - V(x_{s+1}))      (v_L = V(x_L))
    A_s     = rho_s * (r_s + gamma * v_{s+1} - V(x_s))                      (pg advantage)

On-policy with ``rho_bar, c_bar >= 1`` and ``lam = 1``, ``v_s`` is the n-step
(Monte-Carlo up to the bootstrap) return and ``A_s`` its advantage over ``V(x_s)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.ratios import compute_dtype, log_ratio, safe_log, sequence_mean, truncated_exp


@dataclass
class VTraceReturns:
    """Both ``[B, T]``, zero where ``mask`` is False, no gradient."""

    vs: torch.Tensor  # value targets v_s
    pg_advantages: torch.Tensor  # rho_s * (r_s + gamma * v_{s+1} - V(x_s))


def _lengths_of_prefix_mask(mask: torch.Tensor) -> torch.Tensor:
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, mask):
        raise ValueError("vtrace: the valid tokens of each row of `mask` must be a prefix")
    return lengths


def _shift_left(x: torch.Tensor, last: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``y[:, t] = x[:, t+1]``, except ``y = fill[b]`` at each row's last valid step."""
    shifted = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
    return torch.where(last, fill[:, None].expand_as(x), shifted)


@torch.no_grad()
def vtrace(
    behaviour_logprobs: torch.Tensor,
    target_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    mask: torch.Tensor,
    *,
    discount: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> VTraceReturns:
    """V-trace targets. Tensors ``[B, T]``, ``bootstrap_value`` ``[B]`` (0 for a terminated
    episode), ``mask`` bool ``[B, T]`` with each row's valid steps a prefix."""
    lengths = _lengths_of_prefix_mask(mask)
    dtype = compute_dtype(behaviour_logprobs, target_logprobs, rewards, values, bootstrap_value)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    values = torch.where(mask, values.to(dtype), zero)
    rewards = torch.where(mask, rewards.to(dtype), zero)
    bootstrap_value = bootstrap_value.to(dtype)
    lr = log_ratio(target_logprobs, behaviour_logprobs, mask)
    rhos = truncated_exp(lr, rho_bar)
    cs = lam * truncated_exp(lr, c_bar)
    last = torch.arange(mask.shape[1], device=mask.device)[None, :] == (lengths[:, None] - 1)

    next_values = _shift_left(values, last, bootstrap_value)
    deltas = torch.where(mask, rhos * (rewards + discount * next_values - values), zero)
    # Backward recursion v_s - V(x_s) = delta_s + gamma c_s (v_{s+1} - V(x_{s+1})). Padding
    # is a suffix with delta = 0, so the accumulator is still 0 at each row's last step.
    vs_minus_v = torch.zeros_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in range(mask.shape[1] - 1, -1, -1):
        acc = deltas[:, t] + discount * cs[:, t] * acc
        vs_minus_v[:, t] = acc
    vs = torch.where(mask, values + vs_minus_v, zero)
    next_vs = _shift_left(vs, last, bootstrap_value)
    pg_advantages = torch.where(mask, rhos * (rewards + discount * next_vs - values), zero)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


def _group_mean(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, rewards
    )
    return (sums / counts.to(rewards.dtype))[inv]


def _pack_order(mask: torch.Tensor) -> torch.Tensor:
    """Per-row permutation putting valid tokens first, in order (env/tool tokens inside a
    multi-turn response are not actions of the policy, so V-trace skips over them)."""
    return torch.argsort((~mask).to(torch.int8), dim=1, stable=True)


def _unpack(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``torch.gather(x, 1, order)``."""
    return torch.zeros_like(x).scatter_(1, order, x)


BASELINES = ("group_mean", "from_advantages")


class VTraceLoss:
    """V-trace actor-critic loss over a terminal reward.

    Per trajectory: reward ``batch.rewards[b]`` on its last valid token, 0 elsewhere;
    episodes end, so the bootstrap value is 0. ``batch.advantages`` is not used unless
    ``baseline="from_advantages"``. Loss, reduced with ``weighted_sum``::

        -stopgrad(A_s) * logp_s  +  value_coef * 0.5 * (V(x_s) - stopgrad(v_s))^2

    ``use_value_head=True``: ``V`` is ``outputs.values`` (``needs_values``).
    ``use_value_head=False`` (critic-free): ``V(x_t)`` is a per-trajectory constant
    baseline and there is no value loss. ``baseline="group_mean"``: the mean reward of
    the trajectory's group in this batch (groups must not be split across micro-
    batches); ``"from_advantages"``: ``rewards - advantages``, i.e. the baseline the
    configured advantage estimator used over the whole group (meaningful with
    ``GroupCentered``/``LeaveOneOut``). On-policy with ``lam = discount = 1`` and
    ``rho_bar, c_bar >= 1`` the critic-free advantages are ``r - baseline`` for every
    token: Dr. GRPO's (resp. RLOO's).
    """

    needs_proximal = False
    needs_values = True

    def __init__(
        self,
        rho_bar: float = 1.0,
        c_bar: float = 1.0,
        discount: float = 1.0,
        lam: float = 1.0,
        value_coef: float = 0.5,
        use_value_head: bool = True,
        baseline: str = "group_mean",
    ):
        if not (rho_bar > 0 and c_bar > 0):
            raise ValueError(f"loss.rho_bar and loss.c_bar must be > 0, got {rho_bar}, {c_bar}")
        if not (0 <= discount <= 1 and 0 <= lam <= 1):
            raise ValueError(f"loss.discount and loss.lam must be in [0, 1], got {discount}, {lam}")
        if baseline not in BASELINES:
            raise ValueError(f"loss.baseline must be one of {BASELINES}, got {baseline!r}")
        self.rho_bar = float(rho_bar)
        self.c_bar = float(c_bar)
        self.discount = float(discount)
        self.lam = float(lam)
        self.value_coef = float(value_coef)
        self.use_value_head = bool(use_value_head)
        self.needs_values = self.use_value_head
        self.baseline = baseline

    @torch.no_grad()
    def state_values(self, batch: LossBatch, outputs: ModelOutputs) -> torch.Tensor:
        """``[B, T]`` ``V(x_t)`` fed to V-trace (detached)."""
        if self.use_value_head:
            if outputs.values is None:
                raise ValueError(
                    "VTraceLoss(use_value_head=True) needs outputs.values (needs_values=True)"
                )
            return outputs.values.detach()
        rewards = batch.rewards.to(compute_dtype(batch.rewards))
        if self.baseline == "group_mean":
            b = _group_mean(rewards, batch.group_ids)
        else:
            b = rewards - sequence_mean(batch.advantages.to(rewards.dtype), batch.mask)[:, 0]
        return b[:, None].expand(batch.mask.shape)

    @torch.no_grad()
    def targets(self, batch: LossBatch, outputs: ModelOutputs) -> VTraceReturns:
        """V-trace over each row's valid tokens (packed to a prefix and scattered back)."""
        mask = batch.mask
        order = _pack_order(mask)

        def pack(x: torch.Tensor) -> torch.Tensor:
            return torch.gather(x, 1, order)

        packed_mask = pack(mask)
        steps = torch.arange(mask.shape[1], device=mask.device)[None, :]
        last = steps == packed_mask.sum(dim=1, keepdim=True) - 1
        rewards = torch.where(last, batch.rewards[:, None].to(compute_dtype(batch.rewards)), 0.0)
        values = self.state_values(batch, outputs)
        ret = vtrace(
            pack(batch.behaviour_logprobs), pack(outputs.logprobs.detach()), rewards,
            pack(values), torch.zeros_like(batch.rewards, dtype=values.dtype), packed_mask,
            discount=self.discount, rho_bar=self.rho_bar, c_bar=self.c_bar, lam=self.lam,
        )  # fmt: skip
        return VTraceReturns(
            vs=_unpack(ret.vs, order), pg_advantages=_unpack(ret.pg_advantages, order)
        )

    def loss_from_targets(
        self, batch: LossBatch, outputs: ModelOutputs, ret: VTraceReturns
    ) -> LossOutput:
        """The differentiable part, given (constant) V-trace targets."""
        policy = weighted_sum(-ret.pg_advantages * outputs.logprobs, batch)
        metrics = {"loss/policy": float(policy.detach())}
        loss = policy
        if self.use_value_head:
            value = weighted_sum(self.value_coef * 0.5 * (outputs.values - ret.vs) ** 2, batch)
            metrics["loss/value"] = float(value.detach())
            loss = loss + value
        return LossOutput(loss=loss, metrics=metrics)

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        ret = self.targets(batch, outputs)
        out = self.loss_from_targets(batch, outputs, ret)
        out.metrics.update(is_diagnostics(batch, outputs))
        with torch.no_grad():
            lr = log_ratio(outputs.logprobs.detach(), batch.behaviour_logprobs, batch.mask)
            out.metrics["is/clip_frac"] = float(
                masked_mean((lr > safe_log(self.rho_bar)).float(), batch.mask)
            )
            out.metrics["vtrace/advantage_mean"] = float(masked_mean(ret.pg_advantages, batch.mask))
            out.metrics["vtrace/vs_mean"] = float(masked_mean(ret.vs, batch.mask))
        return out
