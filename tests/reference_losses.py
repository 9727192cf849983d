"""Plain float64 reference implementations of the loss maths, for the tests only.

Written to be obviously right rather than fast: Python loops over ``b`` and ``t``,
``math`` for every stop-gradient quantity (ratios, weights, V-trace targets), and
torch *scalar* arithmetic only where the gradient flows (``logp[b, t]`` and
``values[b, t]``), so ``reference(...).backward()`` gives the intended gradient.
Nothing here is vectorised or shared with ``asyncrl.losses``.
"""

from __future__ import annotations

import math

import torch

from asyncrl.losses.base import LossBatch, ModelOutputs

# The documented overflow guard of ratios that carry gradient (ClippedISLoss's
# log_ratio_cap, DecoupledPPOLoss's pi/pi_prox): exp(min(log r, 20)).
LOG_RATIO_CAP = 20.0

# ----------------------------------------------------------------- random inputs


def make_batch(
    B: int = 5,
    T: int = 7,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    lengths: list[int] | None = None,
    holes: bool = False,
    log_ratio_scale: float = 0.3,
    n_groups: int = 2,
) -> tuple[LossBatch, ModelOutputs]:
    """A random batch: prefix masks of the given ``lengths`` (default: random, with an
    empty and a length-1 row), optional holes (env tokens) inside rows, global loss
    weights ``1/N``, per-sequence advantages broadcast over tokens, finite garbage on
    padding, and leaf ``logprobs``/``values`` that require grad."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [0, 1] + torch.randint(2, T + 1, (B - 2,), generator=g).tolist()
    assert len(lengths) == B
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=g) > 0.25
    behaviour = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    proximal = behaviour + log_ratio_scale * torch.randn(B, T, generator=g, dtype=dtype)
    current = proximal + log_ratio_scale * torch.randn(B, T, generator=g, dtype=dtype)
    rewards = torch.randint(0, 3, (B,), generator=g).to(dtype)
    group_ids = torch.randint(0, n_groups, (B,), generator=g) * 7 + 3  # non-contiguous ids
    seq_adv = torch.randn(B, generator=g, dtype=dtype)
    n = int(mask.sum())
    weights = torch.where(
        mask, torch.full((B, T), 1.0 / max(n, 1), dtype=dtype), torch.zeros((), dtype=dtype)
    )
    batch = LossBatch(
        behaviour_logprobs=behaviour,
        versions=torch.randint(0, 12, (B, T), generator=g),
        mask=mask,
        advantages=seq_adv[:, None].expand(B, T).clone(),
        loss_weights=weights,
        rewards=rewards,
        group_ids=group_ids,
        learner_version=12,
        proximal_logprobs=proximal,
    )
    values = torch.randn(B, T, generator=g, dtype=dtype)
    outputs = ModelOutputs(
        logprobs=current.clone().requires_grad_(True), values=values.requires_grad_(True)
    )
    return batch, outputs


def _f(x: torch.Tensor, b: int, t: int | None = None) -> float:
    x = x.detach()
    return float(x[b]) if t is None else float(x[b, t])


def _valid(batch: LossBatch, b: int) -> list[int]:
    return [t for t in range(batch.mask.shape[1]) if bool(batch.mask[b, t])]


# ------------------------------------------------------------------- PG losses


def ref_clipped(
    batch: LossBatch, out: ModelOutputs, clip_low: float, clip_high: float
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            a = _f(batch.advantages, b, t)
            r = torch.exp(
                torch.clamp(
                    out.logprobs[b, t].double() - _f(batch.behaviour_logprobs, b, t),
                    max=LOG_RATIO_CAP,
                )
            )
            term = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
            total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_tis(batch: LossBatch, out: ModelOutputs, level: str, cap: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        ts = _valid(batch, b)
        seq_ratio = 1.0
        for t in ts:
            seq_ratio *= math.exp(_f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t))
        for t in ts:
            tok_ratio = math.exp(_f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t))
            w = min(seq_ratio if level == "sequence" else tok_ratio, cap)
            term = -w * _f(batch.advantages, b, t) * out.logprobs[b, t].double()
            total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_mis(
    batch: LossBatch, out: ModelOutputs, level: str, low: float, high: float
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        ts = _valid(batch, b)
        ratios = [math.exp(_f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t)) for t in ts]
        geo = math.prod(ratios) ** (1.0 / len(ts)) if ts else 1.0
        for t, tok_ratio in zip(ts, ratios, strict=True):
            r = geo if level == "sequence" else tok_ratio
            if not low <= r <= high:
                continue
            term = -r * _f(batch.advantages, b, t) * out.logprobs[b, t].double()
            total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_decoupled(
    batch: LossBatch,
    out: ModelOutputs,
    clip_low: float,
    clip_high: float,
    cap: float,
    level: str = "token",
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        ts = _valid(batch, b)
        seq_w = 1.0
        for t in ts:
            seq_w *= math.exp(
                _f(batch.proximal_logprobs, b, t) - _f(batch.behaviour_logprobs, b, t)
            )
        for t in ts:
            a = _f(batch.advantages, b, t)
            prox = _f(batch.proximal_logprobs, b, t)
            tok_w = math.exp(prox - _f(batch.behaviour_logprobs, b, t))
            behave_w = min(seq_w if level == "sequence" else tok_w, cap)
            r = torch.exp(torch.clamp(out.logprobs[b, t].double() - prox, max=LOG_RATIO_CAP))
            surrogate = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
            total = total + _f(batch.loss_weights, b, t) * behave_w * surrogate
    return total


def ref_plain_pg(batch: LossBatch, out: ModelOutputs, advantages: torch.Tensor) -> torch.Tensor:
    """``-sum_{b,t} w * A * logp``: the on-policy policy gradient every correction reduces to."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            total = (
                total
                - _f(batch.loss_weights, b, t) * _f(advantages, b, t) * out.logprobs[b, t].double()
            )
    return total


def _ratio(out: ModelOutputs, batch: LossBatch, b: int, t: int) -> torch.Tensor:
    """``pi/mu`` of one token with gradient, ``exp(min(log r, 20))``."""
    lr = out.logprobs[b, t].double() - _f(batch.behaviour_logprobs, b, t)
    return torch.exp(torch.clamp(lr, max=LOG_RATIO_CAP))


def ref_binary_divergence(logp: float, mu: float, kind: str) -> float:
    """Binary TV ``|p - q|`` or binary KL(q || p) of "this token or not"."""
    p, q = math.exp(logp), math.exp(mu)
    if kind == "tv":
        return abs(p - q)
    tiny = 2.2250738585072014e-308
    not_p, not_q = max(-math.expm1(logp), tiny), max(-math.expm1(mu), tiny)
    return q * (mu - logp) + not_q * (math.log(not_q) - math.log(not_p))


def ref_dppo_mask(batch, out, divergence: str, low: float, high: float, kl_coef: float):
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            lp, mu = _f(out.logprobs, b, t), _f(batch.behaviour_logprobs, b, t)
            a = _f(batch.advantages, b, t)
            div = ref_binary_divergence(lp, mu, divergence)
            if a > 0:
                dropped = lp > mu and div > high
            else:
                dropped = lp < mu and div > low
            lr = out.logprobs[b, t].double() - mu
            term = kl_coef * lr**2
            if not dropped:
                term = term - _ratio(out, batch, b, t) * a
            total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_loglinear_proximal(batch: LossBatch, out: ModelOutputs, b: int, t: int) -> float:
    """AReaL's log-linear proximal log-prob: ``mu + k/(k+1) (pi - mu)``, ``k`` the staleness."""
    k = max(batch.learner_version - int(batch.versions[b, t]), 0)
    mu = _f(batch.behaviour_logprobs, b, t)
    return mu + k / (k + 1) * (_f(out.logprobs, b, t) - mu)


def _proximal(batch, out, b, t, proximal: str) -> float:
    if proximal == "loglinear":
        return ref_loglinear_proximal(batch, out, b, t)
    return _f(batch.proximal_logprobs, b, t)


def ref_decoupled_loglinear(batch, out, clip_low, clip_high, cap):
    """Token-level decoupled PPO with the log-linear proximal policy."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            a = _f(batch.advantages, b, t)
            prox = ref_loglinear_proximal(batch, out, b, t)
            behave_w = min(math.exp(prox - _f(batch.behaviour_logprobs, b, t)), cap)
            r = torch.exp(torch.clamp(out.logprobs[b, t].double() - prox, max=LOG_RATIO_CAP))
            surrogate = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
            total = total + _f(batch.loss_weights, b, t) * behave_w * surrogate
    return total


def ref_icepop(batch, out, low, high, clip_low, clip_high, proximal="recompute"):
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            a = _f(batch.advantages, b, t)
            prox = _proximal(batch, out, b, t, proximal)
            kappa_lr = prox - _f(batch.behaviour_logprobs, b, t)
            if not (math.log(low) if low > 0 else -math.inf) <= kappa_lr <= math.log(high):
                continue
            r = torch.exp(torch.clamp(out.logprobs[b, t].double() - prox, max=LOG_RATIO_CAP))
            surrogate = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
            total = total + _f(batch.loss_weights, b, t) * math.exp(kappa_lr) * surrogate
    return total


def ref_m2po_keep(batch, out, threshold: float) -> set[tuple[int, int]]:
    """Drop the largest ``(log pi/mu)^2`` (the later position first on ties) while the
    mean of the rest is ``>= threshold``, keeping at least one token."""
    tokens = []
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            lr = _f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t)
            tokens.append((lr * lr, b, t))
    order = sorted(range(len(tokens)), key=lambda i: (tokens[i][0], i))
    kept = [tokens[i] for i in order]
    while len(kept) > 1 and sum(m for m, _, _ in kept) / len(kept) >= threshold:
        kept.pop()
    return {(b, t) for _, b, t in kept}


def ref_m2po(batch, out, threshold: float):
    keep = ref_m2po_keep(batch, out, threshold)
    total = torch.zeros((), dtype=torch.float64)
    for b, t in sorted(keep):
        term = -_ratio(out, batch, b, t) * _f(batch.advantages, b, t)
        total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_gspo(batch, out, clip_low: float, clip_high: float):
    """Per answer ``s = exp(mean_t log pi/mu)``; each token's term ``-min(s A, clip(s) A)``
    with ``s`` a constant times ``exp(logp - sg(logp))`` (value ``s``, gradient ``s``)."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        ts = _valid(batch, b)
        if not ts:
            continue
        lrs = [_f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t) for t in ts]
        seq = math.exp(min(sum(lrs) / len(ts), LOG_RATIO_CAP))
        for t in ts:
            lp = out.logprobs[b, t].double()
            s = seq * torch.exp(lp - lp.detach())
            a = _f(batch.advantages, b, t)
            term = -torch.minimum(s * a, torch.clamp(s, 1 - clip_low, 1 + clip_high) * a)
            total = total + _f(batch.loss_weights, b, t) * term
    return total


def ref_cispo(batch, out, clip_low: float, clip_high: float):
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        for t in _valid(batch, b):
            r = math.exp(min(_f(out.logprobs, b, t) - _f(batch.behaviour_logprobs, b, t), 20.0))
            w = min(max(r, 1 - clip_low), 1 + clip_high)
            term = -w * _f(batch.advantages, b, t) * out.logprobs[b, t].double()
            total = total + _f(batch.loss_weights, b, t) * term
    return total


# --------------------------------------------------------------------- V-trace


def ref_vtrace_row(mu, pi, r, v, bootstrap, *, discount, rho_bar, c_bar, lam):
    """One trajectory, straight from the paper's sum definition (eq. 1 of section 4.1).

    Lists of floats of length L; returns ``(vs, pg_advantages)`` lists."""
    L = len(r)
    rho = [min(rho_bar, math.exp(pi[t] - mu[t])) for t in range(L)]
    c = [lam * min(c_bar, math.exp(pi[t] - mu[t])) for t in range(L)]
    v_ext = list(v) + [bootstrap]
    delta = [rho[t] * (r[t] + discount * v_ext[t + 1] - v_ext[t]) for t in range(L)]
    vs = []
    for s in range(L):
        acc = v_ext[s]
        for t in range(s, L):
            trace = 1.0
            for i in range(s, t):
                trace *= c[i]
            acc += discount ** (t - s) * trace * delta[t]
        vs.append(acc)
    vs_ext = vs + [bootstrap]
    pg = [rho[s] * (r[s] + discount * vs_ext[s + 1] - v_ext[s]) for s in range(L)]
    return vs, pg


def ref_vtrace_row_recursive(mu, pi, r, v, bootstrap, *, discount, rho_bar, c_bar, lam):
    """Same, by the backward recursion v_s = V_s + delta_s + gamma c_s (v_{s+1} - V_{s+1})."""
    L = len(r)
    vs = [0.0] * L
    next_v, next_vs = bootstrap, bootstrap
    for s in reversed(range(L)):
        ratio = math.exp(pi[s] - mu[s])
        rho, c = min(rho_bar, ratio), lam * min(c_bar, ratio)
        delta = rho * (r[s] + discount * next_v - v[s])
        vs[s] = v[s] + delta + discount * c * (next_vs - next_v)
        next_v, next_vs = v[s], vs[s]
    vs_ext = vs + [bootstrap]
    pg = [
        min(rho_bar, math.exp(pi[s] - mu[s])) * (r[s] + discount * vs_ext[s + 1] - v[s])
        for s in range(L)
    ]
    return vs, pg


def ref_group_mean(rewards: torch.Tensor, group_ids: torch.Tensor, b: int) -> float:
    same = [
        float(rewards[j]) for j in range(len(rewards)) if int(group_ids[j]) == int(group_ids[b])
    ]
    return sum(same) / len(same)


def ref_vtrace_loss(
    batch, out, *, rho_bar, c_bar, discount, lam, value_coef, use_value_head, baseline="group_mean"
):
    """V-trace loss over each row's valid tokens in order, terminal reward, bootstrap 0."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch.mask.shape[0]):
        ts = _valid(batch, b)
        if not ts:
            continue
        if use_value_head:
            v = [_f(out.values, b, t) for t in ts]
        elif baseline == "group_mean":
            v = [ref_group_mean(batch.rewards, batch.group_ids, b)] * len(ts)
        else:
            v = [_f(batch.rewards, b) - _f(batch.advantages, b, ts[0])] * len(ts)
        r = [0.0] * (len(ts) - 1) + [_f(batch.rewards, b)]
        mu = [_f(batch.behaviour_logprobs, b, t) for t in ts]
        pi = [_f(out.logprobs, b, t) for t in ts]
        vs, pg = ref_vtrace_row(
            mu, pi, r, v, 0.0, discount=discount, rho_bar=rho_bar, c_bar=c_bar, lam=lam
        )
        for i, t in enumerate(ts):
            term = -pg[i] * out.logprobs[b, t].double()
            if use_value_head:
                term = term + value_coef * 0.5 * (out.values[b, t].double() - vs[i]) ** 2
            total = total + _f(batch.loss_weights, b, t) * term
    return total


# ------------------------------------------------------------------ advantages


def ref_advantages(
    kind: str, rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> list[float]:
    out = []
    for i in range(len(rewards)):
        group = [
            float(rewards[j]) for j in range(len(rewards)) if int(group_ids[j]) == int(group_ids[i])
        ]
        r = float(rewards[i])
        mean = sum(group) / len(group)
        if kind == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / len(group))
            out.append((r - mean) / (std + eps))
        elif kind == "drgrpo":
            out.append(r - mean)
        elif kind == "rloo":
            out.append(0.0 if len(group) == 1 else r - (sum(group) - r) / (len(group) - 1))
        else:
            raise ValueError(kind)
    return out
