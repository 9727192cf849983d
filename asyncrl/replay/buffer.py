"""Replay buffer logic (no Ray here, so it is unit-testable): staleness policy,
group-complete batches, IMPALA-style reuse and exact accounting.

Invariant, at every moment, counted in trajectories:

    produced == trained + dropped_stale + in_queue

``trained`` counts a trajectory once, the first time the learner takes it; reuse
(``max_reuse > 1``) is counted separately in ``samples_trained``.

Staleness of a trajectory seen by a learner at version ``V`` is
``V - min(token versions)``; one with staleness ``> max_staleness`` (the bound in force
at that moment: :meth:`ReplayBuffer.set_max_staleness` moves it) is never handed out:
it is dropped and counted. With ``policy="throttle"`` actors are also held back
before they start a prompt (AReaL's rule: at most ``(V + max_staleness + 1) *
batch_groups`` groups may have been started by learner version ``V``, with ``V`` the
older of the learner's version and the weights the asking actor holds), so drops
become rare; with ``policy="drop"`` actors run free and stale samples are dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from asyncrl.replay.settings import ReplayPolicy

# Accounting counters summed when a saved run and the resumed one meet (resume_from).
_ADDITIVE = (
    "produced", "trained", "dropped_stale", "samples_trained", "groups_started", "groups_dropped",
    "groups_lost",
)  # fmt: skip
# The weights version the queue records for a restarted actor until its first weight
# sync (asyncrl/fault/actors.py): it gets no slot before then.
UNPRIMED = -1


@dataclass
class GroupMeta:
    """Small metadata travelling beside the ObjectRef of one TrajectoryGroup."""

    group_id: str
    traj_ids: list[str]
    min_versions: list[int]  # per trajectory
    num_tokens: list[int]  # per trajectory, prompt + response
    rewards: list[float]  # per trajectory
    actor: str = ""
    # -1: the ref is this TrajectoryGroup itself; i >= 0: the ref is a bundle (one
    # ray.put per hand-off, replay/queue.py Outbox) and this group is its i-th entry
    bundle_index: int = -1


@dataclass
class _Entry:
    ref: Any
    meta: GroupMeta
    alive: list[bool]  # per trajectory: not yet dropped as stale
    uses: int = 0


@dataclass
class BatchItem:
    ref: Any
    group_id: str
    traj_ids: list[str]  # the members to train on (stale members already removed)
    staleness: list[int]
    use: int  # 1 the first time this group is trained on, 2 the second, ...
    bundle_index: int = -1  # see GroupMeta; resolve with replay.queue.resolve_groups


@dataclass
class Accounting:
    produced: int = 0
    trained: int = 0
    dropped_stale: int = 0
    samples_trained: int = 0  # counts reuse
    groups_started: int = 0
    groups_running: int = 0
    groups_dropped: int = 0  # evicted whole before any use: they free their throttle slot
    # granted to an actor that died before putting them (fault/actors.py): freed, never
    # produced, so outside the trajectory invariant
    groups_lost: int = 0
    max_staleness_trained: int = 0
    staleness_hist: dict[int, int] = field(default_factory=dict)


class ReplayBuffer:
    def __init__(
        self,
        max_staleness: int,
        batch_groups: int,
        policy: ReplayPolicy | str = ReplayPolicy.THROTTLE,
        max_reuse: int = 1,
        capacity_groups: int = 0,
        delay_versions: int = 0,
    ):
        if max_staleness < 0:
            raise ValueError(f"replay.max_staleness must be >= 0, got {max_staleness}")
        try:
            policy = ReplayPolicy(policy)
        except ValueError:
            accepted = [p.value for p in ReplayPolicy]
            raise ValueError(f"replay.policy must be one of {accepted}, got {policy!r}") from None
        if max_reuse < 1:
            raise ValueError(f"replay.max_reuse must be >= 1, got {max_reuse}")
        if delay_versions > max_staleness:
            raise ValueError(
                f"replay.delay_versions={delay_versions} exceeds replay.max_staleness={max_staleness}:"
                " every sample would be dropped"
            )
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.policy = policy
        self.max_reuse = max_reuse
        self._capacity_setting = capacity_groups  # 0: follows the bound in force
        self.capacity_groups = self._capacity_for(max_staleness)
        self.delay_versions = delay_versions
        self.bound_changes = 0  # set_max_staleness calls that moved the bound
        self.highest_bound = max_staleness  # the widest bound ever in force
        self.learner_version = 0
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        # No queued trajectory is older than this (a lower bound, tightened by each full
        # walk): evict_stale returns at once while even the oldest is within the bound,
        # instead of walking the queue on every wake-up of a waiting get_batch.
        self._oldest: int | None = None
        self.acc = Accounting()
        # Per actor (by name): slots granted and not yet put or given back, groups lost
        # with a dead actor, and when its current incarnation put its first group.
        self.running_by_actor: dict[str, int] = {}
        self.lost_by_actor: dict[str, int] = {}
        self.first_put_at: dict[str, float] = {}

    def _capacity_for(self, bound: int) -> int:
        """Backpressure: queued + running groups stay under this. Default: enough for
        the staleness window, so throttling (not the queue) is what bounds the actors."""
        return self._capacity_setting or (bound + 2) * self.batch_groups

    def set_max_staleness(self, bound: int) -> int:
        """The bound in force from now on (``replay.max_staleness=auto``). Narrowing
        drops at once every queued trajectory now staler than ``bound`` (counted in
        ``dropped_stale``), so no later :meth:`take` can hand one out; widening lets
        the throttled actors start more. Returns how many were dropped."""
        if bound < 0:
            raise ValueError(f"replay.max_staleness must be >= 0, got {bound}")
        if bound < self.delay_versions:
            raise ValueError(
                f"replay.max_staleness={bound} is below replay.delay_versions="
                f"{self.delay_versions}: every sample would be dropped"
            )
        if bound != self.max_staleness:
            self.bound_changes += 1
        self.max_staleness = bound
        self.highest_bound = max(self.highest_bound, bound)
        self.capacity_groups = self._capacity_for(bound)
        return self.evict_stale()

    # ---- actor side -------------------------------------------------------------
    def can_start(self, weights_version: int | None = None) -> bool:
        """May an actor start generating one more group now? ``weights_version``: the
        policy version the actor holds (None: assume the learner's). Groups are trained
        in the order they start, the n-th in batch ``n // batch_groups``, so one started
        with weights ``v`` stays within the bound if ``n < (v + max_staleness + 1) *
        batch_groups``; an actor whose weights lag (a sync still on its way) is held
        back rather than making samples that would be dropped."""
        if weights_version is not None and weights_version <= UNPRIMED:
            return False  # a restarted actor before its first weight sync
        if len(self._queue) + self.acc.groups_running >= self.capacity_groups:
            return False
        if self.policy is ReplayPolicy.THROTTLE:
            v = self.learner_version
            if weights_version is not None:
                v = min(v, weights_version)
            window = (v + self.max_staleness + 1) * self.batch_groups
            return self.acc.groups_started - self.acc.groups_dropped < window
        return True

    def start(self, actor: str | None = None) -> None:
        self.acc.groups_started += 1
        self.acc.groups_running += 1
        if actor:
            self.running_by_actor[actor] = self.running_by_actor.get(actor, 0) + 1

    def abandon(self, actor: str | None = None) -> None:
        """A started group will never be put (its generation failed)."""
        self.acc.groups_running = max(0, self.acc.groups_running - 1)
        self.acc.groups_started = max(0, self.acc.groups_started - 1)
        self._done_running(actor)

    def _done_running(self, actor: str | None) -> None:
        if actor and self.running_by_actor.get(actor, 0) > 0:
            self.running_by_actor[actor] -= 1

    def actor_lost(self, actor: str) -> int:
        """``actor`` died: the slots it was granted and never put or gave back are freed
        (as :meth:`abandon`: they leave the throttle window) and counted in
        ``groups_lost``. Its groups already put stay queued. Returns how many."""
        n = min(self.running_by_actor.pop(actor, 0), self.acc.groups_running)
        for _ in range(n):
            self.abandon()
        self.acc.groups_lost += n
        self.lost_by_actor[actor] = self.lost_by_actor.get(actor, 0) + n
        self.first_put_at.pop(actor, None)
        return n

    def put(self, ref: Any, meta: GroupMeta) -> None:
        if meta.group_id in self._queue:
            raise ValueError(f"group {meta.group_id} was put twice")
        self.acc.groups_running = max(0, self.acc.groups_running - 1)
        self._done_running(meta.actor)
        if meta.actor:
            self.first_put_at.setdefault(meta.actor, time.time())
        self.acc.produced += len(meta.traj_ids)
        self._queue[meta.group_id] = _Entry(ref, meta, [True] * len(meta.traj_ids))
        if meta.min_versions:
            low = min(meta.min_versions)
            self._oldest = low if self._oldest is None else min(self._oldest, low)

    # ---- learner side -----------------------------------------------------------
    def set_learner_version(self, version: int) -> None:
        self.learner_version = max(self.learner_version, version)

    def evict_stale(self) -> int:
        """Drop every trajectory older than the bound; returns how many were dropped."""
        if self._oldest is None or self.learner_version - self._oldest <= self.max_staleness:
            return 0  # not even the oldest queued trajectory is stale
        dropped = 0
        oldest: int | None = None
        for gid in list(self._queue):
            e = self._queue[gid]
            for i, v in enumerate(e.meta.min_versions):
                if e.alive[i] and self.learner_version - v > self.max_staleness:
                    e.alive[i] = False
                    dropped += 1
                    if e.uses == 0:
                        self.acc.dropped_stale += 1
                elif e.alive[i]:
                    oldest = v if oldest is None else min(oldest, v)
            if not any(e.alive):
                del self._queue[gid]
                if e.uses == 0:
                    self.acc.groups_dropped += 1
        self._oldest = oldest
        return dropped

    def _ready(self, e: _Entry) -> bool:
        # delay mode (benchmarks): a group only becomes visible once the learner is
        # exactly `delay_versions` past its oldest token, so staleness is controlled.
        # The first `delay_versions` versions have no data that old: there the delay
        # ramps up (staleness = learner_version, version-0 data), else the learner
        # would wait at version 0 forever.
        if not self.delay_versions:
            return True
        delay = min(self.delay_versions, self.learner_version)
        return self.learner_version - min(e.meta.min_versions) >= delay

    def ready_groups(self) -> int:
        if not self.delay_versions:
            return len(self._queue)  # every queued group is ready
        return sum(self._ready(e) for e in self._queue.values())

    def take(self, num_groups: int) -> list[BatchItem]:
        """Oldest-first, whole groups; [] unless ``num_groups`` groups are ready."""
        self.evict_stale()
        ready = [gid for gid, e in self._queue.items() if self._ready(e)]
        if len(ready) < num_groups:
            return []
        out = []
        for gid in ready[:num_groups]:
            e = self._queue[gid]
            idx = [i for i, a in enumerate(e.alive) if a]
            stale = [self.learner_version - e.meta.min_versions[i] for i in idx]
            e.uses += 1
            if e.uses == 1:
                self.acc.trained += len(idx)
            self.acc.samples_trained += len(idx)
            for s in stale:
                self.acc.staleness_hist[s] = self.acc.staleness_hist.get(s, 0) + 1
                self.acc.max_staleness_trained = max(self.acc.max_staleness_trained, s)
            out.append(
                BatchItem(
                    e.ref,
                    gid,
                    [e.meta.traj_ids[i] for i in idx],
                    stale,
                    e.uses,
                    e.meta.bundle_index,
                )
            )
            del self._queue[gid]
            if e.uses < self.max_reuse:
                self._queue[gid] = e  # back of the line for its next use
        return out

    # ---- accounting -------------------------------------------------------------
    @property
    def in_queue(self) -> int:
        """Trajectories produced and neither trained nor dropped yet."""
        return sum(sum(e.alive) for e in self._queue.values() if e.uses == 0)

    def stats(self) -> dict[str, Any]:
        a = self.acc
        return {
            "produced": a.produced,
            "trained": a.trained,
            "dropped_stale": a.dropped_stale,
            "in_flight": self.in_queue,
            "samples_trained": a.samples_trained,
            "groups_running": a.groups_running,
            "groups_lost": a.groups_lost,
            "groups_lost_by_actor": dict(self.lost_by_actor),
            "first_put_at": dict(self.first_put_at),
            "depth_groups": len(self._queue),
            "max_staleness_trained": a.max_staleness_trained,
            "staleness_hist": dict(a.staleness_hist),
            "learner_version": self.learner_version,
            "max_staleness": self.max_staleness,  # the bound in force
            "highest_bound": self.highest_bound,
            "bound_changes": self.bound_changes,
        }

    def state_dict(self) -> dict[str, Any]:
        """Accounting only: queued ObjectRefs die with the run, so a resumed run
        counts what was queued at the checkpoint as dropped (see load_state_dict)."""
        return {"acc": vars(self.acc).copy(), "learner_version": self.learner_version}

    def load_state_dict(self, state: dict[str, Any], lost_in_queue: int = 0) -> None:
        self.acc = Accounting(**state["acc"])
        self.acc.groups_running = 0
        self.acc.staleness_hist = {int(k): v for k, v in self.acc.staleness_hist.items()}
        self.learner_version = state["learner_version"]
        self.acc.dropped_stale += lost_in_queue

    def resume_from(self, state: dict[str, Any]) -> dict[str, Any]:
        """Merge a checkpoint's accounting into this live buffer, whose actors started
        before the load: what this run counted so far is added on top; what was queued
        or generating at the checkpoint is lost (its trajectories count as dropped, its
        groups leave the throttle window: the old run keeps exactly the
        ``V * batch_groups`` it trained). Returns :meth:`stats`."""
        live = dataclasses.replace(self.acc)
        saved = state["acc"]
        lost = saved["produced"] - saved["trained"] - saved["dropped_stale"]
        self.load_state_dict(state, lost_in_queue=lost)
        acc = self.acc
        for f in _ADDITIVE:
            setattr(acc, f, getattr(acc, f) + getattr(live, f))
        acc.groups_running = live.groups_running
        outstanding = saved["groups_started"] - saved["groups_dropped"]
        acc.groups_dropped += max(0, outstanding - state["learner_version"] * self.batch_groups)
        acc.max_staleness_trained = max(acc.max_staleness_trained, live.max_staleness_trained)
        for k, v in live.staleness_hist.items():
            acc.staleness_hist[k] = acc.staleness_hist.get(k, 0) + v
        return self.stats()
