"""Per-group statistics the hacking monitors read (asyncrl/monitor/hacking.py), computed
where a group's rewards are: ``dup_frac`` and ``dominant_share`` go into each
trajectory's breakdown, so the learner logs their batch means as ``reward/<key>``."""

from __future__ import annotations

NGRAM = 3  # token 3-grams: a reworded answer still shares most of them with its twin


def _shingles(ids: list[int]) -> frozenset:
    if len(ids) < NGRAM:
        return frozenset([tuple(ids)])
    return frozenset(tuple(ids[i : i + NGRAM]) for i in range(len(ids) - NGRAM + 1))


def dup_frac(responses: list[list[int]], min_tokens: int, near: float) -> float:
    """Share of the group's responses (at least ``min_tokens`` long) that equal, or have
    a token-3-gram Jaccard similarity of at least ``near`` with, an earlier one."""
    seen: list[frozenset] = []
    dups = 0
    for ids in responses:
        if len(ids) < min_tokens:
            continue
        sh = _shingles(ids)
        if any(len(sh & o) >= near * len(sh | o) for o in seen):
            dups += 1
        seen.append(sh)
    return dups / len(responses) if responses else 0.0


def dominant_share(contributions: list[dict[str, float]]) -> float | None:
    """The largest component's share of sum |weight x value| over the group; None with
    fewer than two components or nothing scored."""
    totals: dict[str, float] = {}
    for c in contributions:
        for k, v in c.items():
            totals[k] = totals.get(k, 0.0) + abs(v)
    s = sum(totals.values())
    if len(totals) < 2 or s <= 0:
        return None
    return max(totals.values()) / s
