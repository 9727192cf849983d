"""One black-box agent episode's record: the calls it made to the endpoint
(asyncrl/actor/endpoint.py), kept as branches of token ids, one trajectory each.

    call k: messages ─▶ rendered text T (the model's chat template)
            find the branch whose text T extends (its rendered prompt + every completion
            and segment so far, as text)
              found:   segment = T[len(branch.text):], tokenized alone (mask 0);
                       the request is branch.tokens + segment ids
              none:    a fork: a new branch whose prompt is T tokenized
            engine ─▶ completion ids, behaviour log-probs, versions (mask 1)

Invariants (what the learner relies on, as asyncrl/actor/episode.py states):

* A branch's ``prompt_ids + ids`` is exactly the token sequence of its last request
  followed by that request's completion: each call's request extends the branch's
  previous request and completion, token for token, by construction.
* ``mask`` is True only on the engine's generated ids; segment tokens carry log-prob 0
  and the version of the generated token before them.
* The branch test is on the rendered text, not on the agent's history re-tokenized:
  text the model generated tokenizes differently when a BPE tokenizer sees it whole,
  which is no divergence; an agent that drops, summarises or edits a turn renders a
  text that no branch's text prefixes, and the call starts a new branch (a fork), so
  no trajectory ever holds tokens the engine did not see in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncrl.trajectory import Trajectory, token_fields


@dataclass
class Branch:
    """One trajectory's growing record (per-token lists of equal length ``R``)."""

    prompt_ids: list[int]
    prompt_text: str
    text: str  # prompt_text + every completion (decoded with special tokens) and segment
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)  # the completions (for rewards)
    calls: int = 0
    prompt_tokens: int = 0  # over the branch's requests
    cached_tokens: int = 0
    forked: bool = False  # started by a call whose history no earlier branch's text prefixed

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.ids

    def copy(self) -> Branch:
        return Branch(
            list(self.prompt_ids), self.prompt_text, self.text, list(self.ids),
            list(self.logprobs), list(self.versions), list(self.mask), list(self.generated),
            self.calls, self.prompt_tokens, self.cached_tokens, self.forked,
        )  # fmt: skip

    def add_segment(self, ids: list[int], text: str, fallback_version: int) -> None:
        """Append what the model did not generate (mask 0, log-prob 0)."""
        version = self.versions[-1] if self.versions else fallback_version
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [False] * len(ids)
        self.text += text

    def add_completion(
        self, ids: np.ndarray, lps: np.ndarray, vers: np.ndarray, text: str, shown: str
    ) -> None:
        """Append one completion: ``text`` decoded with special tokens (what the next
        render must repeat), ``shown`` what the agent got back."""
        self.ids += ids.tolist()
        self.logprobs += lps.tolist()
        self.versions += vers.tolist()
        self.mask += [True] * len(ids)
        self.text += text
        self.generated.append(shown)
        self.calls += 1


@dataclass
class Plan:
    """Where call k goes: ``base`` (None: a fork, whose prompt is ``segment``) and the
    rendered text it appends."""

    base: Branch | None
    segment: str
    snapshot: Branch | None = None  # the base when planned: a concurrent call may extend it


@dataclass
class EpisodeLog:
    """Every branch of one episode, in the order they started."""

    episode_id: str
    group: int = 0  # the group's place in the actor's start order (the sampling seeds)
    sample: int = 0
    branches: list[Branch] = field(default_factory=list)
    calls: int = 0
    forks: int = 0  # branches started after the first: the agent rewrote its history
    aborted: bool = False  # a weight update aborted a request (update_mode=abort)
    closed: bool = False

    def plan(self, rendered: str) -> Plan:
        """The branch ``rendered`` extends (the longest text that prefixes it)."""
        best = None
        for b in self.branches:
            if rendered.startswith(b.text) and (best is None or len(b.text) > len(best.text)):
                best = b
        if best is None:
            return Plan(None, rendered)
        return Plan(best, rendered[len(best.text) :], best.copy())

    def take(self, plan: Plan) -> Branch:
        """The branch a planned call extends: its base, unless a concurrent call of the
        episode extended the base since (then a new branch holding the base as planned,
        whose text the call's render extends, never the base's later tokens)."""
        if plan.base.calls == plan.snapshot.calls:
            return plan.base
        self.branches.append(plan.snapshot)
        return plan.snapshot

    def start(self, prompt_ids: list[int], prompt_text: str) -> Branch:
        """A new branch (the first call's, or a fork)."""
        b = Branch(list(prompt_ids), prompt_text, prompt_text, forked=bool(self.branches))
        self.forks += b.forked
        self.branches.append(b)
        return b

    def spawn(self, parent: Branch) -> Branch:
        """A sibling of ``parent`` (another choice of one call with ``n > 1``): the same
        prefix, its own completion; the agent continues whichever it likes."""
        b = parent.copy()
        self.branches.append(b)
        return b


def branch_trajectory(
    b: Branch, traj_id: str, group_id: str, reward: float, finish: str, error: str,
    t_start: float, t_end: float,
) -> Trajectory:  # fmt: skip
    """One branch as a Trajectory (shapes: asyncrl/trajectory.py); ``episode["forks"]``
    is 1 on a forked branch, so the actor's sums count forks."""
    return Trajectory(
        traj_id=traj_id,
        group_id=group_id,
        **token_fields(b.prompt_ids, b.ids, b.logprobs, b.versions, b.mask),
        reward=reward,
        finish_reason=finish,
        error=error,
        prompt_text=b.prompt_text,
        response_text=b.text[len(b.prompt_text) :],
        t_start=t_start,
        t_end=t_end,
        episode={
            "turns": float(b.calls),
            "tool_calls": 0.0,
            "turn_prompt_tokens": float(b.prompt_tokens),
            "cached_tokens": float(b.cached_tokens),
            "forks": float(b.forked),
        },
    )
