"""A calibrated discrete-event model of asyncrl at scale, and of the synchronous loop on
the same resources. Pure Python (stdlib + NumPy), seeded; its figures are predictions of
the model, never measurements.

    throttle: groups started <= (V + bound + 1) x batch_groups, queued + generating <= capacity
        │
        ▼ a group of n episodes, to the engine with the fewest groups in flight
    engine e (continuous batching: at most `cap` sequences decode; a decode step of b
        │      sequences takes step0 + step1 * b seconds, one token each)
        │ turn done ─▶ env call (lognormal) ─▶ next turn ... ─▶ reward (lognormal)
        ▼ every member done ─▶ hand-off (handoff_s)
    queue: a member with V - min(its token versions) > bound is dropped and counted
        ▼ batch_groups groups, oldest first
    learner: M ranks, train_fixed_s + tokens * train_token_s / M, then publish_s
        │      (and step_overhead_s more before its next batch: the driver's calls)
        ▼ the weights to every engine: sync_fixed_s + bytes / bandwidth, paused per
          update mode: keep (in-flight sequences freeze, then continue, their min
          version unchanged), abort (in-flight episodes start again from the prompt on
          the new weights, their tokens wasted), wait (no new sequence starts; the
          in-flight ones finish, then the reload)

On a host whose parts share its cores (``cpu_cores``, the 2-core host): a decoding engine,
a training learner and the always-runnable rest share the cores; each busy part runs at
min(1, cores / runnable) of its speed alone, re-shared at every event (processor sharing).

The synchronous loop: each turn generates every live episode at once on all engines (HF
``generate`` pads: the batch decodes to its longest row; vLLM frees a row when it ends),
then awaits every env call of the turn together (the slowest decides), then the reward,
the training step on all ranks, the weight reload.

    python -m benchmarks.simulate                # the prediction tables (docs/speed.md)
    python -m benchmarks.simulate --validate     # predicted vs measured, one JSON line
    python -m benchmarks.simulate --quick        # fewer steps, smaller tables

Invariant (checked by tests/test_simulate.py): every episode finished is trained, dropped
as stale, or still in the queue; none staler than the bound in force is trained.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses  # noqa: E402
import heapq  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from collections import deque  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
AUTO = "auto"


# ---- the workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Lognormal:
    """Seconds or tokens drawn lognormally from a median and a 99th percentile; median 0:
    always 0; ``cap`` clips (a generation length's max_tokens)."""

    median: float = 0.0
    p99: float = 0.0
    cap: float = math.inf

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.median <= 0:
            return np.zeros(size)
        sigma = max(math.log(max(self.p99, self.median) / self.median), 0.0) / Z99
        return np.minimum(rng.lognormal(math.log(self.median), sigma, size), self.cap)


@dataclass(frozen=True)
class Workload:
    """One job: ``batch_groups`` groups of ``group_size`` episodes a step; an episode makes
    ``calls`` tool calls (Binomial(max_calls, calls_mean / max_calls)), so calls + 1 turns,
    each generating ``turn_tokens`` tokens; an env call answers after ``env_s`` and puts
    ``obs_tokens`` tokens into the episode (trained on as context, not generated)."""

    batch_groups: int
    group_size: int
    prompt_tokens: int
    turn_tokens: Lognormal
    calls_mean: float = 0.0
    max_calls: int = 0
    obs_tokens: int = 0
    env_s: Lognormal = Lognormal()
    reward_s: Lognormal = Lognormal()


@dataclass
class Episode:
    id: int
    group: Group
    turns: list[int]  # tokens generated per turn
    env_s: list[float]  # the env call after each turn but the last
    reward_s: float
    turn: int = 0
    done_tokens: float = 0.0  # generated so far in this attempt (lost on abort)
    min_version: int | None = None
    engine: int = -1

    @property
    def tokens(self) -> int:
        return sum(self.turns) + len(self.env_s) * self.group.obs_tokens + self.group.prompt


@dataclass
class Group:
    id: int
    prompt: int
    obs_tokens: int
    members: list[Episode] = field(default_factory=list)
    left: int = 0
    engine: int = -1


def draw_group(w: Workload, gid: int, first_id: int, rng: np.random.Generator) -> Group:
    g = Group(gid, w.prompt_tokens, w.obs_tokens)
    p = min(w.calls_mean / w.max_calls, 1.0) if w.max_calls else 0.0
    calls = rng.binomial(w.max_calls, p, w.group_size) if w.max_calls else [0] * w.group_size
    for i, c in enumerate(calls):
        turns = [max(1, int(round(x))) for x in w.turn_tokens.draw(rng, int(c) + 1)]
        env = [float(x) for x in w.env_s.draw(rng, int(c))]
        reward = float(w.reward_s.draw(rng, 1)[0])
        g.members.append(Episode(first_id + i, g, turns, env, reward))
    g.left = len(g.members)
    return g


# ---- the resources and their costs ----------------------------------------------------------
@dataclass(frozen=True)
class AsyncSetup:
    """asyncrl on ``engines`` inference engines and ``trainers`` learner ranks."""

    engines: int
    cap: int  # sequences one engine decodes at once (vLLM max_num_seqs / KV room)
    step0: float  # seconds of a decode step, fixed part (weights read, launch, scheduler)
    step1: float  # seconds of a decode step per sequence in it (compute, KV read)
    trainers: int
    train_fixed_s: float  # per learner step (optimizer, collectives, batch fetch)
    train_token_s: float  # seconds per trained token on one rank
    publish_s: float  # the learner's pause per step to hand its weights over
    sync_fixed_s: float  # an engine's pause per update besides the payload
    sync_bytes: float  # payload per update
    sync_gbps: float  # GB/s of the transfer
    bound: int | str = 2  # replay.max_staleness (an int or "auto")
    # throttle | drop (replay.policy); or "quota", verl fully-async's rule (its
    # FullyAsyncRollouter: at every weight update the starts allowed until the next are
    # capacity_groups less the groups then generating or queued; nothing else frees room;
    # capacity_groups below batch_groups x publish_every holds the learner short for ever)
    policy: str = "throttle"
    capacity_groups: int = 0  # 0: (bound + 2) x batch_groups (replay.capacity_groups)
    max_inflight_groups: int = 256  # per engine (actor.max_inflight_groups)
    update_mode: str = "keep"  # abort | wait | keep (actor.update_mode)
    handoff_s: float = 0.0  # a finished group's way into the queue
    auto_floor: int = 1  # replay.auto_floor / auto_ceiling / auto_widen_after
    auto_ceiling: int = 8
    auto_widen_after: int = 5
    startup_s: float = 0.0  # process start to the first trained step
    shutdown_s: float = 0.0  # the last step to the process's exit
    step_overhead_s: float = 0.0  # per step past the publish: the driver's stats and metrics
    publish_every: int = 1  # learner steps per weight update (verl's trigger_parameter_sync_step)
    # A host whose parts share its cores (cpu_cores 0: every part on its own device, as on
    # a GPU cluster; else the cores the run gets, other users' jobs at a higher priority
    # taken out). A decoding engine keeps ``engine_cpu`` cores' worth of threads runnable,
    # a training learner ``learner_cpu``; ``background_cpu`` are always runnable (the
    # driver, the queue, the broker, Ray's own processes). Every busy part then runs at
    # min(1, cpu_cores / runnable) of its speed alone (processor sharing).
    cpu_cores: float = 0.0
    engine_cpu: float = 1.0
    learner_cpu: float = 1.0
    background_cpu: float = 0.0

    @property
    def sync_seconds(self) -> float:
        return self.sync_fixed_s + self.sync_bytes / (self.sync_gbps * 1e9)


@dataclass(frozen=True)
class SyncSetup:
    """The synchronous loop: generate on ``engines``, train on ``trainers`` ranks, reload."""

    engines: int
    cap: int
    step0: float
    step1: float
    padded: bool  # HF generate: every row decodes to the batch's longest
    trainers: int
    train_fixed_s: float
    train_token_s: float
    reload_s: float = 0.0  # per step: the new weights into the generator
    startup_s: float = 0.0
    shutdown_s: float = 0.0


# ---- the asynchronous runtime ---------------------------------------------------------------
class Engine:
    """Processor sharing in virtual time: every running sequence gains one token per
    decode step, so ``vclock`` (tokens per sequence so far) advances at 1 / step time and
    a sequence ends when the clock reaches its tag."""

    def __init__(self, idx: int, s: AsyncSetup):
        self.idx, self.s = idx, s
        self.active: dict[int, tuple[Episode, float]] = {}  # id -> (episode, tag)
        self.tags: list[tuple[float, int]] = []
        self.waiting: deque[Episode] = deque()
        self.vclock = self.t = 0.0
        self.epoch = 0
        self.paused = self.draining = self.syncing = False
        self.version = 0
        self.target = 0  # newest version published to this engine
        self.groups = 0
        self.busy_s = self.paused_s = 0.0
        self.speed = 1.0  # the share of its CPU it gets (AsyncSim.reshare)

    def decoding(self) -> bool:
        return bool(self.active) and not self.paused

    def rate(self) -> float:
        b = len(self.active)
        return 0.0 if b == 0 or self.paused else self.speed / (self.s.step0 + self.s.step1 * b)

    def advance(self, now: float) -> None:
        dt = now - self.t
        r = self.rate()
        self.vclock += dt * r
        self.busy_s += dt if r > 0 else 0.0
        self.paused_s += dt if self.paused else 0.0
        self.t = now


class AsyncSim:
    """One run of asyncrl's loop (see the module's picture) until ``steps`` learner steps."""

    def __init__(self, w: Workload, s: AsyncSetup, steps: int, seed: int = 0):
        self.w, self.s, self.steps = w, s, steps
        self.rng = np.random.default_rng(seed)
        self.events: list[tuple[float, int, str, tuple]] = []
        self.seq = itertools.count()
        self.engines = [Engine(i, s) for i in range(s.engines)]
        self.queue: deque[Group] = deque()
        self.version = 0
        self.bound = s.auto_floor if s.bound == AUTO else int(s.bound)
        self.started = self.generating = self.queued = 0
        self.local_steps = 0  # learner steps; a version every publish_every of them
        self.quota_used = 0  # policy quota: groups started, or in the system at the update
        self.next_id = itertools.count()
        self.training = self.publishing = False
        self.step_done: list[float] = []
        self.counts = dict(produced=0, trained=0, dropped=0, aborted=0)
        self.staleness: list[int] = []
        self.bounds_trained: list[int] = []
        self.trained_at: list[int] = []  # the learner's step each staleness was seen at
        self.tokens_generated = self.tokens_wasted = 0.0
        self.learner = dict(train=0.0, publish=0.0)
        self.speed = 1.0  # every busy part's share of its speed alone (cpu_cores)
        self.train_left = 0.0  # the step's work left (seconds alone) as of train_t
        self.train_t = 0.0
        self.train_epoch = 0
        self.train_began = 0.0
        self.actor_idle_s = 0.0  # no group in flight (the runtime's perf/actor_idle_frac)
        self.speed_s = 0.0  # the integral of speed over time

    # -- the event loop
    def push(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    def run(self) -> AsyncSim:
        self.now = 0.0
        self.try_start()
        self.reshare()
        while self.events and len(self.step_done) < self.steps:
            t, _, kind, args = heapq.heappop(self.events)
            if not any(e.groups for e in self.engines):
                self.actor_idle_s += t - self.now
            self.speed_s += (t - self.now) * self.speed
            self.now = t
            getattr(self, "on_" + kind)(*args)
            self.reshare()
        return self

    # -- the host's cores, shared
    def share(self) -> float:
        """Every busy part's speed as a fraction of its speed alone: processor sharing of
        ``cpu_cores`` among the runnable threads (1 where the parts have their own devices)."""
        s = self.s
        if not s.cpu_cores:
            return 1.0
        decoding = sum(e.decoding() for e in self.engines)
        runnable = s.background_cpu + s.learner_cpu * self.training + s.engine_cpu * decoding
        return min(1.0, s.cpu_cores / runnable) if runnable > 0 else 1.0

    def reshare(self) -> None:
        """After every event: the parts' speeds follow who is runnable now; the engines'
        clocks and the learner's step are brought up to now at the old speed first."""
        f = self.share()
        if f == self.speed:
            return
        for e in self.engines:
            e.advance(self.now)
            e.speed = f
            self.schedule(e)
        if self.training:
            self.train_left -= (self.now - self.train_t) * self.speed
            self.train_t = self.now
            self.train_epoch += 1
            self.push(self.now + max(self.train_left, 0.0) / f, "train_done", self.train_epoch)
        self.speed = f

    # -- actors: the throttle and the engines
    def capacity(self) -> int:
        per_version = self.w.batch_groups * self.s.publish_every
        return self.s.capacity_groups or (self.bound + 2) * per_version

    def may_start(self, e: Engine) -> bool:
        if self.generating + self.queued >= self.capacity():
            return False
        if e.groups >= self.s.max_inflight_groups:
            return False
        if self.s.policy == "quota":
            return self.quota_used < self.capacity()
        if self.s.policy == "throttle":
            v = min(self.version, e.version)
            per_version = self.w.batch_groups * self.s.publish_every
            return self.started < (v + self.bound + 1) * per_version
        return True

    def try_start(self) -> None:
        while True:
            e = min(self.engines, key=lambda x: x.groups)
            if not self.may_start(e):
                return
            g = draw_group(self.w, self.started, next(self.next_id) * self.w.group_size, self.rng)
            self.started += 1
            self.quota_used += 1
            self.generating += 1
            e.groups += 1
            g.engine = e.idx
            for ep in g.members:
                ep.engine = e.idx
                e.waiting.append(ep)
            self.admit(e)

    def admit(self, e: Engine) -> None:
        e.advance(self.now)
        if not (e.paused or e.draining):
            while e.waiting and len(e.active) < self.s.cap:
                ep = e.waiting.popleft()
                if ep.min_version is None:
                    ep.min_version = e.version
                tag = e.vclock + ep.turns[ep.turn]
                e.active[ep.id] = (ep, tag)
                heapq.heappush(e.tags, (tag, ep.id))
        self.schedule(e)

    def schedule(self, e: Engine) -> None:
        e.epoch += 1
        while e.tags and (
            e.tags[0][1] not in e.active or e.active[e.tags[0][1]][1] != e.tags[0][0]
        ):
            heapq.heappop(e.tags)
        r = e.rate()
        if e.tags and r > 0:
            self.push(self.now + max(e.tags[0][0] - e.vclock, 0.0) / r, "engine", e.idx, e.epoch)

    def on_engine(self, idx: int, epoch: int) -> None:
        e = self.engines[idx]
        if epoch != e.epoch:
            return
        e.advance(self.now)
        eps = 1e-9 * max(1.0, e.vclock)
        while e.tags and e.tags[0][0] <= e.vclock + eps:
            _, eid = heapq.heappop(e.tags)
            if eid in e.active:
                ep, _ = e.active.pop(eid)
                self.tokens_generated += ep.turns[ep.turn]
                ep.done_tokens += ep.turns[ep.turn]
                self.turn_done(ep)
        if e.draining and not e.active:
            self.begin_reload(e)
        self.admit(e)
        self.try_start()

    def turn_done(self, ep: Episode) -> None:
        if ep.turn < len(ep.env_s):
            self.push(self.now + ep.env_s[ep.turn], "env", ep)
        else:
            self.push(self.now + ep.reward_s, "reward", ep)

    def on_env(self, ep: Episode) -> None:
        ep.turn += 1
        e = self.engines[ep.engine]
        e.waiting.append(ep)
        self.admit(e)

    def on_reward(self, ep: Episode) -> None:
        g = ep.group
        g.left -= 1
        if g.left == 0:
            self.engines[g.engine].groups -= 1
            self.push(self.now + self.s.handoff_s, "handoff", g)
            self.try_start()

    def on_handoff(self, g: Group) -> None:
        self.generating -= 1
        self.queued += 1
        self.counts["produced"] += len(g.members)
        self.queue.append(g)
        self.try_train()

    # -- weight updates
    def on_publish_done(self) -> None:
        self.quota_used = self.generating + self.queued
        for e in self.engines:
            e.target = self.version
            if not e.syncing:
                self.begin_sync(e)
        self.try_start()

    def begin_sync(self, e: Engine) -> None:
        e.syncing = True
        if self.s.update_mode == "wait":
            e.advance(self.now)
            e.draining = True
            if not e.active:
                self.begin_reload(e)
            return
        self.begin_reload(e)

    def begin_reload(self, e: Engine) -> None:
        e.advance(self.now)
        e.draining, e.paused = False, True
        if self.s.update_mode == "abort":
            for ep, tag in list(e.active.values()):
                self.abort(e, ep, tag)
            e.active.clear()
        self.schedule(e)
        self.push(self.now + self.s.sync_seconds, "reload_done", e.idx, e.target)

    def abort(self, e: Engine, ep: Episode, tag: float) -> None:
        """The episode runs again from its prompt on the new weights."""
        partial = ep.turns[ep.turn] - max(tag - e.vclock, 0.0)
        self.tokens_generated += partial
        self.tokens_wasted += partial + ep.done_tokens
        self.counts["aborted"] += 1
        ep.turn, ep.done_tokens, ep.min_version = 0, 0.0, None
        e.waiting.appendleft(ep)

    def on_reload_done(self, idx: int, version: int) -> None:
        e = self.engines[idx]
        e.advance(self.now)
        e.paused, e.syncing, e.version = False, False, version
        if e.target > e.version:
            self.begin_sync(e)
        self.admit(e)
        self.try_start()

    # -- the learner
    def evict_stale(self) -> None:
        keep: deque[Group] = deque()
        for g in self.queue:
            alive = [m for m in g.members if self.version - m.min_version <= self.bound]
            self.counts["dropped"] += len(g.members) - len(alive)
            g.members = alive
            if alive:
                keep.append(g)
            else:
                self.queued -= 1
        self.queue = keep

    def try_train(self) -> None:
        if self.training or self.publishing:
            return
        self.evict_stale()
        if len(self.queue) < self.w.batch_groups:
            return
        batch = [self.queue.popleft() for _ in range(self.w.batch_groups)]
        self.queued -= len(batch)
        tokens = 0
        for g in batch:
            for m in g.members:
                self.staleness.append(self.version - m.min_version)
                self.bounds_trained.append(self.bound)
                self.trained_at.append(self.local_steps)
                tokens += m.tokens
            self.counts["trained"] += len(g.members)
        s = self.s
        self.training = True
        self.train_left = s.train_fixed_s + tokens * s.train_token_s / s.trainers
        self.train_t = self.train_began = self.now
        self.train_epoch += 1
        self.push(self.now + self.train_left / self.speed, "train_done", self.train_epoch)
        self.try_start()

    def on_train_done(self, epoch: int) -> None:
        if epoch != self.train_epoch:  # rescheduled by reshare
            return
        self.learner["train"] += self.now - self.train_began
        self.training, self.publishing = False, True
        self.step_done.append(self.now)
        s = self.s
        self.local_steps += 1
        if self.local_steps % s.publish_every:  # a local update: no new weights yet
            self.learner["publish"] += s.step_overhead_s
            self.push(self.now + s.step_overhead_s, "learner_free")
            return
        self.version += 1
        if s.bound == AUTO and self.version % s.auto_widen_after == 0:
            self.bound = min(self.bound + 1, s.auto_ceiling)  # healthy steps: widen
        self.learner["publish"] += s.publish_s + s.step_overhead_s
        self.push(self.now + s.publish_s, "publish_done")
        self.push(self.now + s.publish_s + s.step_overhead_s, "learner_free")

    def on_learner_free(self) -> None:
        self.publishing = False
        self.try_train()

    # -- figures
    def in_queue(self) -> int:
        return sum(len(g.members) for g in self.queue)


def async_figures(sim: AsyncSim, warmup: int) -> dict:
    """Steady state over the steps after ``warmup``, as benchmarks/vs_sync.py reads a run."""
    t = sim.step_done
    k = min(warmup, len(t) - 2)
    per_step = (t[-1] - t[k]) / (len(t) - 1 - k)
    span = sim.now or 1.0
    samples = sim.w.batch_groups * sim.w.group_size
    tokens_per_step = sim.tokens_generated / max(len(t), 1)
    st = np.asarray(sim.staleness)[np.asarray(sim.trained_at, dtype=int) >= k]  # steady state
    hist = {str(v): float(np.mean(st == v)) for v in range(int(st.max()) + 1)} if st.size else {}
    return {
        "seconds_per_step": per_step,
        "samples_per_s": samples / per_step,
        "tokens_per_s": tokens_per_step / (span / max(len(t), 1)),
        "staleness_mean": float(st.mean()) if st.size else 0.0,
        "staleness_max": int(st.max()) if st.size else 0,
        "staleness_hist": hist,
        "bound_end": sim.bound,
        "dropped_fraction": sim.counts["dropped"] / max(sim.counts["produced"], 1),
        "wasted_token_fraction": sim.tokens_wasted / max(sim.tokens_generated, 1.0),
        "engine_busy": float(np.mean([e.busy_s for e in sim.engines])) / span,
        "engine_paused": float(np.mean([e.paused_s for e in sim.engines])) / span,
        "learner_train": sim.learner["train"] / span,
        "learner_publish": sim.learner["publish"] / span,
        "learner_wait": 1.0 - (sim.learner["train"] + sim.learner["publish"]) / span,
        "actor_idle": sim.actor_idle_s / span,
        "cpu_share": sim.speed_s / span,  # the parts' mean speed as a share of alone
        "run_seconds": span,
    }


# ---- the synchronous loop -------------------------------------------------------------------
def makespan(lengths: list[int], cap: int, step0: float, step1: float, padded: bool) -> float:
    """Seconds for one engine to decode ``lengths`` (all submitted at once, at most
    ``cap`` at a time). Padded: each chunk of ``cap`` rows decodes to its longest."""
    if not lengths:
        return 0.0
    if padded:
        chunks = [lengths[i : i + cap] for i in range(0, len(lengths), cap)]
        return sum(max(c) * (step0 + step1 * len(c)) for c in chunks)
    waiting = deque(sorted(lengths, reverse=False))
    active: list[float] = []
    vclock = t = 0.0
    while waiting or active:
        while waiting and len(active) < cap:
            heapq.heappush(active, vclock + waiting.popleft())
        tag = heapq.heappop(active)
        t += (tag - vclock) * (step0 + step1 * (len(active) + 1))
        vclock = tag
    return t


def sync_step(w: Workload, s: SyncSetup, rng: np.random.Generator) -> dict:
    """One synchronous step: turn by turn over the live episodes, then train, reload."""
    groups = [draw_group(w, i, i * w.group_size, rng) for i in range(w.batch_groups)]
    eps = [m for g in groups for m in g.members]
    gen = env = 0.0
    for turn in range(max(len(e.turns) for e in eps)):
        live = [e for e in eps if turn < len(e.turns)]
        per_engine = [[e.turns[turn] for e in live[i :: s.engines]] for i in range(s.engines)]
        gen += max(makespan(x, s.cap, s.step0, s.step1, s.padded) for x in per_engine)
        calls = [e.env_s[turn] for e in live if turn < len(e.env_s)]
        env += max(calls, default=0.0)
    reward = max(e.reward_s for e in eps)
    tokens = sum(e.tokens for e in eps)
    train = s.train_fixed_s + tokens * s.train_token_s / s.trainers
    gen_tokens = sum(sum(e.turns) for e in eps)
    return dict(generate=gen, env=env, reward=reward, train=train, reload=s.reload_s,
                tokens=gen_tokens, samples=len(eps))  # fmt: skip


def sync_figures(w: Workload, s: SyncSetup, steps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + 1)
    rows = [sync_step(w, s, rng) for _ in range(steps)]
    parts = ("generate", "env", "reward", "train", "reload")
    mean = {k: float(np.mean([r[k] for r in rows])) for k in (*parts, "tokens", "samples")}
    per_step = sum(mean[k] for k in parts)
    return {
        "seconds_per_step": per_step,
        "samples_per_s": mean["samples"] / per_step,
        "tokens_per_s": mean["tokens"] / per_step,
        **{f"share_{k}": mean[k] / per_step for k in parts},
        **{f"{k}_seconds": mean[k] for k in parts},
    }


def compare(w: Workload, a: AsyncSetup, s: SyncSetup, steps: int, seed: int = 0,
            warmup: int = 3, total_steps: int | None = None) -> dict:  # fmt: skip
    """Both sides on one job: per-step figures over ``steps`` simulated steps, their ratio,
    and whole runs of ``total_steps`` (default ``steps``): asyncrl's start-up to its first
    trained step (``startup_s``, as summary.json's startup_seconds), the steady state for
    the rest, shut-down."""
    sim = AsyncSim(w, a, steps, seed).run()
    af, sf = async_figures(sim, warmup), sync_figures(w, s, min(steps, 20), seed)
    n = total_steps or steps
    a_total = a.startup_s + (n - 1) * af["seconds_per_step"] + a.shutdown_s
    s_total = s.startup_s + n * sf["seconds_per_step"] + s.shutdown_s
    return {
        "ratio": sf["seconds_per_step"] / af["seconds_per_step"],
        "total_ratio": s_total / a_total,
        "async": af,
        "sync": sf,
        "async_total_seconds": a_total,
        "sync_total_seconds": s_total,
        "counts": dict(sim.counts, in_queue=sim.in_queue()),
    }


# ---- GPU clusters: costs from the hardware's datasheet and stated efficiencies -------------
@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: float  # dense bf16, datasheet
    hbm_tbs: float  # memory bandwidth, datasheet
    mem_gb: float
    link_gbs: float  # per-GPU network bandwidth the weight broadcast gets between nodes


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int  # GPUs per inference engine

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Datasheets: NVIDIA H20 (148 TFLOPS bf16 dense, 4.0 TB/s, 96 GB); H100 SXM (989, 3.35, 80).
H20 = Gpu("H20", 148.0, 4.0, 96.0, 25.0)
H100 = Gpu("H100", 989.0, 3.35, 80.0, 25.0)
# Qwen2.5 configs (config.json): 7B 28 layers, 4 KV heads of 128; 32B 64 layers, 8 KV heads.
QWEN_7B = Model("7B", 7.6e9, 28, 4, 128, tp=1)
QWEN_32B = Model("32B", 32.8e9, 64, 8, 128, tp=4)

# The model's stated efficiencies (assumptions, one set for every GPU prediction):
BW_EFF = 0.7  # fraction of HBM bandwidth a decode step reaches
DECODE_MFU = 0.5  # fraction of peak FLOPs the per-sequence part of a decode step reaches
TRAIN_MFU = 0.35  # of the learner's forward + backward (6 x params FLOPs a token)
TRAIN_FLOPS_PER_PARAM = 8  # 6 (forward + backward) + 2 (the current log-probs' forward)
LAUNCH_S = 0.002  # per decode step: scheduler and kernel launches
TP_ALLREDUCE_S = 30e-6  # per all-reduce of a tensor-parallel decode step (two a layer)
MAX_NUM_SEQS = 256  # vLLM's default cap on sequences in one engine
KV_FRACTION = 0.9  # of an engine's memory, weights taken out, for the KV cache
SYNC_FIXED_S = 1.0  # an engine's pause per update besides the payload (pause, reload, resume)
OPTIMIZER_S = 2.0  # per learner step: optimizer step and gradient reduction's tail
RELOAD_LOCAL_GBS = 100.0  # the colocated loop's weights into its engines (NVLink-class copy)
RELOAD_FIXED_S = 5.0  # the colocated loop's switch between training and generation (offload)


def engine_costs(m: Model, g: Gpu, mean_context: float) -> tuple[int, float, float]:
    """(cap, step0, step1) of one engine of ``m.tp`` GPUs at a mean context length."""
    bw = m.tp * g.hbm_tbs * 1e12 * BW_EFF
    step0 = 2 * m.params / bw + LAUNCH_S + (2 * m.layers * TP_ALLREDUCE_S if m.tp > 1 else 0.0)
    step1 = (
        2 * m.params / (m.tp * g.tflops * 1e12 * DECODE_MFU)
        + m.kv_bytes_per_token * mean_context / bw
    )
    room = m.tp * g.mem_gb * 1e9 * KV_FRACTION - 2 * m.params
    cap = int(max(1, min(MAX_NUM_SEQS, room / (m.kv_bytes_per_token * max(mean_context, 1.0)))))
    return cap, step0, step1


def mean_context(w: Workload) -> float:
    """Mean tokens in a decoding sequence's context (the prompt and half its answer)."""
    return w.prompt_tokens + 0.5 * float(
        np.mean(w.turn_tokens.draw(np.random.default_rng(0), 4096))
    )


def gpu_setups(
    m: Model, g: Gpu, w: Workload, gpus: int, gen_gpus: int, **kw
) -> tuple[AsyncSetup, SyncSetup]:
    """asyncrl with ``gen_gpus`` for inference and the rest training, against the
    colocated synchronous loop generating and training on all ``gpus``."""
    cap, step0, step1 = engine_costs(m, g, mean_context(w))
    token_s = TRAIN_FLOPS_PER_PARAM * m.params / (g.tflops * 1e12 * TRAIN_MFU)
    a = AsyncSetup(
        engines=gen_gpus // m.tp, cap=cap, step0=step0, step1=step1, trainers=gpus - gen_gpus,
        train_fixed_s=OPTIMIZER_S, train_token_s=token_s, publish_s=0.0,
        sync_fixed_s=SYNC_FIXED_S, sync_bytes=2 * m.params, sync_gbps=g.link_gbs, **kw,
    )  # fmt: skip
    s = SyncSetup(
        engines=gpus // m.tp, cap=cap, step0=step0, step1=step1, padded=False, trainers=gpus,
        train_fixed_s=OPTIMIZER_S, train_token_s=token_s,
        reload_s=RELOAD_FIXED_S + 2 * m.params / (RELOAD_LOCAL_GBS * 1e9),
    )  # fmt: skip
    return a, s


# ---- the published cases: verl fully-async, Qwen2.5-Math-7B on 32-128 H20 ------------------
# verl docs/advance/fully_async.md (github.com/volcengine/verl, "Asynchronous Training on 7B
# Model", its 32/64/128-card table and the "128-card Stale Ablation" table): H20, DAPO,
# rollout.n 16, ppo_mini_batch_size 32, colocate sync train_batch_size 512; fully_async_policy
# require_batches 4, trigger_parameter_sync_step 4 (a weight update every 4 x 4 x 32 = 512
# prompts), staleness_threshold 0.5, partial_rollout True; max_response_length 28K. Its scripts
# (verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_{16_16,32_32,64_64}.sh): gen_tp
# 4 (an engine is 4 GPUs), max_prompt_length 2K; the 16_16 and 32_32 scripts set
# staleness_threshold 0.1, the doc 0.5 (the doc's is used). verl's FullyAsyncRollouter: at most
# 16 samples (prompts, n answers each) in flight per server, and the "quota" policy above with
# (1 + staleness_threshold) x 512 prompts; verl's rollout.yaml: max_num_seqs 256.
@dataclass(frozen=True)
class VerlRun:
    """One row pair of verl's tables: the colocate sync run and a fully_async_policy run."""

    name: str
    gpus: int
    gen_gpus: int
    sync_step_s: float  # the colocate sync row: step, gen, old_log_prob, update_actor
    sync_gen_s: float
    sync_logprob_s: float
    sync_update_s: float
    async_step_s: float  # the fully_async_policy row: step, update_actor
    async_update_s: float
    staleness_threshold: float
    partial_rollout: bool
    sync_total_h: float  # "total time 400 step", both rows
    async_total_h: float

    @property
    def speedup(self) -> float:
        return self.sync_total_h / self.async_total_h


VERL_COMMON = dict(prompts=512, n=16, mini=32, require_batches=4, trigger=4,
                   max_response=28 * 1024, gen_tp=4, server_samples=16)  # fmt: skip
VERL_PROMPT_TOKENS = 256  # assumed: DAPO-Math-17k's prompts in the chat template (max 2K)
_SYNC128 = dict(gpus=128, gen_gpus=64, sync_step_s=356.30, sync_gen_s=177.85,
                sync_logprob_s=53.92, sync_update_s=113.81, sync_total_h=40 + 48 / 60)  # fmt: skip
VERL_RUNS = [
    VerlRun("128 cards 64:64, staleness 0.5", **_SYNC128, async_step_s=150.63,
            async_update_s=113.16, staleness_threshold=0.5, partial_rollout=True,
            async_total_h=17 + 22 / 60),
    VerlRun("64 cards 32:32, staleness 0.5", 64, 32, 365.28, 150.72, 70.26, 133.41, 189.26,
            156.98, 0.5, True, 41 + 32 / 60, 21 + 40 / 60),
    VerlRun("32 cards 16:16, staleness 0.5", 32, 16, 790.10, 357.41, 107.71, 269.80, 294.77,
            313.81, 0.5, True, 89 + 5 / 60, 33 + 26 / 60),
    # the 128-card stale ablation (staleness 0 is the "stream off policy pipeline" row)
    VerlRun("128 cards 64:64, staleness 0", **_SYNC128, async_step_s=231.34,
            async_update_s=98.77, staleness_threshold=0.0, partial_rollout=False,
            async_total_h=25 + 53 / 60),
    VerlRun("128 cards 64:64, staleness 0.1", **_SYNC128, async_step_s=171.30,
            async_update_s=109.12, staleness_threshold=0.1, partial_rollout=True,
            async_total_h=19 + 59 / 60),
    VerlRun("128 cards 64:64, staleness 0.3", **_SYNC128, async_step_s=146.11,
            async_update_s=103.22, staleness_threshold=0.3, partial_rollout=True,
            async_total_h=17 + 20 / 60),
]  # fmt: skip
VERL = VERL_RUNS[0]  # the headline case: 2.35x


DRAWS = 4  # batches the sync side's tail is averaged over (its longest answer varies)


# assumed: the spread of a response's length (log-space sigma), the reasoning job's below
# (p99 6 x the median)
VERL_SIGMA = math.log(6.0) / Z99


def verl_costs(v: VerlRun, m: Model, g: Gpu, sigma: float = VERL_SIGMA) -> tuple[Lognormal, float]:
    """Response lengths and the engines' speed from the sync run's stated phases. The mean
    length from update_actor's seconds (tokens = seconds x GPUs / a token's cost at
    TRAIN_MFU), lognormal of spread ``sigma``, cut at max_response_length. The engines'
    slowness (a factor on the datasheet's step costs, ``engine_costs``) that makes this
    model's colocated generation of one batch (every engine decoding its share, the batch
    waiting for the longest) last the stated gen seconds (bisection on the factor)."""
    c = VERL_COMMON
    samples = c["prompts"] * c["n"]
    token_s = 6 * m.params / (g.tflops * 1e12 * TRAIN_MFU)
    mean = v.sync_update_s * v.gpus / token_s / samples - VERL_PROMPT_TOKENS
    cap, step0, step1 = engine_costs(m, g, VERL_PROMPT_TOKENS + mean / 2)
    engines = v.gpus // m.tp
    zs = np.random.default_rng(0).standard_normal((DRAWS, engines, samples // engines))
    lengths = np.minimum(mean * np.exp(sigma * zs - sigma**2 / 2), c["max_response"])
    rows = [[[int(x) for x in r] for r in batch] for batch in lengths]

    def gen_seconds(f: float) -> float:
        """The mean over DRAWS batches of the slowest engine's share."""
        return float(np.mean([max(makespan(r, cap, f * step0, f * step1, False) for r in batch)
                              for batch in rows]))  # fmt: skip

    lo, hi = 0.1, 20.0
    for _ in range(24):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gen_seconds(mid) < v.sync_gen_s else (lo, mid)
    median = mean * math.exp(-(sigma**2) / 2)
    return Lognormal(median, median * math.exp(Z99 * sigma), c["max_response"]), lo


def verl_case(v: VerlRun = VERL, updates: int = 12, seed: int = 0, same_trainer: bool = False,
              engines: int = 2, sigma: float = VERL_SIGMA) -> dict:  # fmt: skip
    """The model's prediction of one verl speedup. Each side's trainer costs its stated
    seconds per step (sync: update_actor + old_log_prob on all GPUs; async: update_actor
    on its share); the engines (gen_tp GPUs each) cost the H20's datasheet at the stated
    efficiencies. The async side as verl runs it: a learner step per require_batches x
    ppo_mini_batch_size prompts, a weight update every trigger_parameter_sync_step of
    them; 16 prompts in flight per engine, each holding its slot until its last answer
    ends; starts between two updates limited by the quota policy at (1 +
    staleness_threshold) x 512 prompts, no version bound; partial rollout is ``keep``,
    its absence ``wait``. The async side runs ``engines`` of the cluster's engines and
    the same share of the trainers and of the batch (the same seconds per step: every
    rank's and engine's share is the same), for ``updates`` weight updates, the first
    third left out. ``same_trainer``: the async trainer at the sync one's per-GPU speed."""
    c, g = VERL_COMMON, H20
    m = dataclasses.replace(QWEN_7B, tp=c["gen_tp"])
    lengths, slow = verl_costs(v, m, g, sigma)
    w = Workload(c["prompts"], c["n"], VERL_PROMPT_TOKENS, lengths)
    a, s = gpu_setups(m, g, w, v.gpus, v.gen_gpus)
    a = dataclasses.replace(a, step0=a.step0 * slow, step1=a.step1 * slow)
    s = dataclasses.replace(s, step0=s.step0 * slow, step1=s.step1 * slow)
    draws = lengths.draw(np.random.default_rng(1), 65536)
    tokens = c["prompts"] * c["n"] * (VERL_PROMPT_TOKENS + float(np.mean(draws)))
    sync_train = v.sync_update_s + v.sync_logprob_s
    async_train = v.async_update_s
    if same_trainer:
        async_train = v.sync_update_s * v.gpus / (v.gpus - v.gen_gpus)
    s = dataclasses.replace(s, train_fixed_s=0.0, train_token_s=sync_train * s.trainers / tokens)
    scale = a.engines // engines
    local = c["require_batches"] * c["mini"] // scale  # prompts a learner step
    small = dataclasses.replace(w, batch_groups=local)
    a = dataclasses.replace(
        a, engines=engines, trainers=a.trainers // scale, policy="quota", bound=10**6,
        capacity_groups=int((1 + v.staleness_threshold) * c["prompts"] / scale),
        max_inflight_groups=c["server_samples"], publish_every=c["trigger"],
        update_mode="keep" if v.partial_rollout else "wait",
        train_fixed_s=0.0, train_token_s=async_train * a.trainers / tokens,
    )  # fmt: skip
    sim = AsyncSim(small, a, updates * c["trigger"], seed).run()
    af, sf = async_figures(sim, updates // 3 * c["trigger"]), sync_figures(w, s, DRAWS, seed)
    async_step = af["seconds_per_step"] * c["trigger"]
    return {"name": v.name, "ratio": sf["seconds_per_step"] / async_step,
            "async_seconds_per_step": async_step, "sync_seconds_per_step": sf["seconds_per_step"],
            "published": {"speedup": v.speedup, "async_step_s": v.async_step_s,
                          "sync_step_s": v.sync_step_s, "step_ratio": v.sync_step_s / v.async_step_s},
            "engine_slowness": slow, "async": af, "sync": sf,
            "lengths": dataclasses.asdict(lengths)}  # fmt: skip


# ---- the published case: AReaL v0.3 (boba²), R1-Distill-Qwen-1.5B on 128 H800 -----------
# AReaL's paper (github.com/inclusionAI/AReaL assets/paper.pdf, arXiv 2505.24298): Table 1,
# 1.5B on 16 nodes, 250 PPO steps, Sync.AReaL 41.0 h, AReaL 14.8 h (2.77x; blog/AReaL_v0_3.md
# says 1000 steps, the same hours); 6.1: H800 nodes of 8 GPUs, RoCE 3.2 Tbps a node, three
# quarters of the devices for inference, eta 8 for math; 4.1: the throttle
# floor((N_r - 1) / B) <= i + eta (asyncrl's throttle); 3.1: interruptible rollout (``keep``);
# Table 3: 512 prompts x 16 answers, 4 PPO minibatches, max prompt 1024, max generation
# 27648. blog/AReaL_v0_3.md Fig. 7 (the 1.5B's effective training throughput, k tokens/s, by
# eta; its cluster is not stated, assumed this one): eta 0 128.7, 1 269.3, 2 356.6, 4 356.6,
# 8 371.7, 16 382.4, unbounded 396.8. Not stated, assumed: the response lengths (AReaL v0.1's
# blog, Fig. 1: the same base model's mean 4,100-7,100 tokens over its 8K-24K run; taken
# 6,000, spread VERL_SIGMA), the prompt (256 tokens), and the synchronous variant: the
# colocated loop on all 128 GPUs (its ``sync`` reading), or AReaL itself at eta 0 on the
# 96:32 split (``eta0``; the paper: "when eta = 0, our system degenerates to synchronous RL").
H800 = Gpu("H800", 989.0, 3.35, 80.0, 3.2e12 / 8 / 8 / 1e9)  # H100 SXM's compute and HBM
# config.json: 28 layers, 2 KV heads of 128 (hidden 1536, 12 heads), 1.78B parameters
R1_QWEN_1_5B = Model("1.5B", 1.78e9, 28, 2, 128, tp=1)
AREAL = dict(gpus=128, gen_gpus=96, prompts=512, n=16, max_response=27648, eta=8,
             sync_h=41.0, async_h=14.8, mean_response=6000.0, prompt_tokens=256)  # fmt: skip
AREAL_FIG7 = {0: 128.7, 1: 269.3, 2: 356.6, 4: 356.6, 8: 371.7, 16: 382.4, AUTO: 396.8}
UNBOUNDED = 10**6  # a bound never reached (Fig. 7's "infinity")


def areal_case(eta: int = AREAL["eta"], steps: int = 36, seed: int = 0, engines: int = 3) -> dict:
    """The model's prediction of AReaL's 1.5B speedup at ``eta`` (UNBOUNDED: none): costs
    from the H800 datasheet at the stated efficiencies (no phase times are published to
    calibrate from), asyncrl's throttle at ``eta``, ``keep``; the async side at ``engines``
    of the 96 engines and the same share of the trainers and of the batch; ``steps`` learner
    steps, the first third left out. Against both readings of the synchronous variant."""
    v, m, g = AREAL, R1_QWEN_1_5B, H800
    sigma = VERL_SIGMA
    median = v["mean_response"] * math.exp(-(sigma**2) / 2)
    lengths = Lognormal(median, median * math.exp(Z99 * sigma), v["max_response"])
    w = Workload(v["prompts"], v["n"], v["prompt_tokens"], lengths)
    a, s = gpu_setups(m, g, w, v["gpus"], v["gen_gpus"])
    scale = a.engines // engines
    small = dataclasses.replace(w, batch_groups=v["prompts"] // scale)

    def run(bound: int) -> dict:
        setup = dataclasses.replace(a, engines=engines, trainers=a.trainers // scale, bound=bound,
                                    update_mode="keep")  # fmt: skip
        return async_figures(AsyncSim(small, setup, steps, seed).run(), steps // 3)

    af, a0 = run(eta), run(0)
    sf = sync_figures(w, s, DRAWS, seed)
    return {"ratio": sf["seconds_per_step"] / af["seconds_per_step"],
            "ratio_eta0": a0["seconds_per_step"] / af["seconds_per_step"],
            "async_seconds_per_step": af["seconds_per_step"],
            "eta0_seconds_per_step": a0["seconds_per_step"],
            "sync_seconds_per_step": sf["seconds_per_step"],
            "published": {"speedup": v["sync_h"] / v["async_h"],
                          "sync_s_per_step_250": v["sync_h"] * 3600 / 250,
                          "async_s_per_step_250": v["async_h"] * 3600 / 250},
            "async": af, "eta0": a0, "sync": sf, "lengths": dataclasses.asdict(lengths)}  # fmt: skip


def areal_fig7(steps: int = 36, seed: int = 0, engines: int = 3) -> list[dict]:
    """Fig. 7's throughput at each eta against eta 0, predicted (the same setup)."""
    base = areal_case(0, steps, seed, engines)["async_seconds_per_step"]
    out = []
    for eta, k in AREAL_FIG7.items():
        r = areal_case(UNBOUNDED if eta == AUTO else eta, steps, seed, engines)
        out.append({"eta": "unbounded" if eta == AUTO else eta,
                    "predicted": base / r["async_seconds_per_step"],
                    "measured": k / AREAL_FIG7[0], "staleness_mean": r["async"]["staleness_mean"],
                    "async_seconds_per_step": r["async_seconds_per_step"]})  # fmt: skip
    return out


# ---- predictions: a 7B and a 32B model on 8-128 GPUs ------------------------------------------
# Two jobs of one global batch (strong scaling: more GPUs, the same batch), both assumed:
# long chain-of-thought answers checked by a fast verifier, and an agentic job whose tool
# calls wait on a sandbox or a service and whose reward is an LLM judge's.
JOBS = {
    "reasoning": Workload(
        batch_groups=256, group_size=8, prompt_tokens=256,
        turn_tokens=Lognormal(2048, 12288, 16384), reward_s=Lognormal(0.05, 0.5),
    ),
    "agentic": Workload(
        batch_groups=256, group_size=8, prompt_tokens=512,
        turn_tokens=Lognormal(256, 2048, 4096), calls_mean=3.0, max_calls=6, obs_tokens=256,
        env_s=Lognormal(1.0, 10.0), reward_s=Lognormal(2.0, 10.0),
    ),
}  # fmt: skip
MODELS = {"7B": QWEN_7B, "32B": QWEN_32B}
GPUS = (8, 32, 128)
GEN_SHARES = (0.25, 0.5, 0.75)  # fractions of the GPUs that generate (the rest train)
PRED_STEPS = 10


def predict(job: str, model: str, gpus: int, share: float, steps: int = PRED_STEPS, **kw) -> dict:
    """One cell: asyncrl (``share`` of ``gpus`` generating) against the colocated loop."""
    m, w = MODELS[model], JOBS[job]
    gen = min(max(m.tp, int(round(gpus * share / m.tp)) * m.tp), (gpus - 1) // m.tp * m.tp)
    a, s = gpu_setups(m, H100, w, gpus, gen, **kw)
    r = compare(w, a, s, steps)
    af = r["async"]
    return {
        "job": job, "model": model, "gpus": gpus, "engines_to_trainers": f"{gen}:{gpus - gen}",
        "update_mode": a.update_mode, "bound": a.bound, "speedup": r["ratio"],
        "async_s_per_step": af["seconds_per_step"], "sync_s_per_step": r["sync"]["seconds_per_step"],
        "staleness_mean": af["staleness_mean"], "staleness_max": af["staleness_max"],
        "staleness_hist": af["staleness_hist"], "dropped": af["dropped_fraction"],
        "wasted_tokens": af["wasted_token_fraction"], "engine_busy": af["engine_busy"],
        "learner_busy": af["learner_train"], "sync_share_generate": r["sync"]["share_generate"],
    }  # fmt: skip


def prediction_tables(quick: bool = False) -> dict:
    """The best engines-to-trainers split per (job, model, GPUs), then update modes and
    bounds on one cluster."""
    steps = 6 if quick else PRED_STEPS
    gpus = GPUS[:2] if quick else GPUS
    best = []
    for job, model, n in itertools.product(JOBS, MODELS, gpus):
        cells = [predict(job, model, n, share, steps) for share in GEN_SHARES]
        best.append(max(cells, key=lambda c: c["speedup"]) | {"splits": {
            c["engines_to_trainers"]: round(c["speedup"], 2) for c in cells}})  # fmt: skip
    modes = []
    for mode, bound in itertools.product(("keep", "abort", "wait"), (1, 2, 4, AUTO)):
        modes.append(predict("reasoning", "7B", 32, 0.5, steps, update_mode=mode, bound=bound))
    return {"best_split": best, "update_modes": modes}


# ---- the command line (this host's calibration and validation: benchmarks/simulate_host.py) ---
def main() -> None:
    from benchmarks.common import emit_json, parser, print_table

    p = parser("simulate", __doc__)
    p.add_argument("--validate", action="store_true", help="predicted vs measured figures")
    args = p.parse_args()
    if args.validate:
        from benchmarks.simulate_host import validate

        out = validate(args.quick)
        print_table("simulate: predicted vs measured (one calibration set)",
                    ["case", "figure", "predicted", "measured", "error", "goal"],
                    [[c["name"], c["figure"], c["predicted"], c["measured"], c["error"], c["goal"]]
                     for c in out["cases"]])  # fmt: skip
        emit_json(out)
        return
    tables = prediction_tables(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "predictions.json").write_text(json.dumps(tables, indent=1))
    cols = ["job", "model", "gpus", "engines_to_trainers", "speedup", "async_s_per_step",
            "sync_s_per_step", "staleness_mean", "staleness_max", "bound", "dropped"]  # fmt: skip
    print_table("simulate: best split per cluster (predictions)", cols,
                [[r[k] for k in cols] for r in tables["best_split"]])  # fmt: skip
    cols2 = ["update_mode", "bound", "speedup", "staleness_mean", "staleness_max", "dropped",
             "wasted_tokens", "engine_busy"]  # fmt: skip
    print_table("simulate: 7B reasoning on 32 GPUs (16:16), update mode x bound (predictions)",
                cols2, [[r[k] for k in cols2] for r in tables["update_modes"]])  # fmt: skip
    emit_json({"best_split": tables["best_split"], "update_modes": tables["update_modes"]})


if __name__ == "__main__":
    main()
