"""RolloutActor bookkeeping without an engine: the queue is faked at the Ray boundary,
the engine (or the whole episode) at the episode seam (actor/episode.py)."""

from __future__ import annotations

import asyncio
import functools

import pytest
from controlled_actor import ControlledRolloutActor
from fake_engine import FakeEngine

from asyncrl.actor.episode import SingleTurnEpisodes
from asyncrl.actor.rollout import RolloutActor
from asyncrl.actor.settings import ActorSettings
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.replay.queue import ReplayQueueCore
from asyncrl.tasks.arithmetic import AdditionTask


class _Queue:
    """What the actor calls on its queue actor, counted."""

    def __init__(self):
        self.abandoned = 0
        outer = self

        class _Abandon:
            def remote(self, n=1, actor=None):  # actor: whose slots (asyncrl/fault)
                outer.abandoned += n

        self.abandon = _Abandon()


def _actor(queue, cls: type = ControlledRolloutActor, **kw) -> RolloutActor:
    """A ControlledRolloutActor (or ``cls``) on the addition task, not started;
    ``kw``: ActorSettings fields."""
    return cls("t", "/nonexistent", AdditionTask(), queue, ActorSettings.defaults(**kw))


def test_a_group_cancelled_before_it_ran_frees_its_slot():
    """A task cancelled before its first step never runs its own finally: the done
    callback must still count it down and give its queue slot back."""

    async def main():
        q = _Queue()
        a = _actor(q, max_inflight_groups=4)
        ran = []

        async def group():
            ran.append(1)

        tasks = []
        for _ in range(3):
            a.slots.inflight += 1
            t = asyncio.create_task(group())
            t.add_done_callback(functools.partial(a._group_done, q))
            tasks.append(t)
        tasks[0].cancel()  # before it ever ran
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        return a, q, ran

    a, q, ran = asyncio.run(main())
    assert len(ran) == 2  # the cancelled one never started
    assert a.slots.inflight == 0 and q.abandoned == 1


class _FakeEpisodes:
    """An EpisodeRunner in place of vLLM: a group takes a few ms and yields two
    one-token trajectories. The actor's loop, slots and outbox stay real."""

    def __init__(self, actor: RolloutActor, seconds: tuple[float, float] = (0.002, 0.004)):
        self.actor = actor
        self.seconds = seconds  # a group takes the first + 0, 1 or 2 x the second
        self.peak = 0  # most groups generating at once
        self.runs = 0

    async def run_group(self, prompt):
        import numpy as np

        from asyncrl.trajectory import Trajectory, TrajectoryGroup

        self.peak = max(self.peak, self.actor.slots.inflight)
        await asyncio.sleep(self.seconds[0] + self.seconds[1] * (hash(prompt.text) % 3))
        gid = f"g{self.runs}-{id(prompt)}"
        self.runs += 1
        trajs = [
            Trajectory(f"{gid}-{i}", gid, np.arange(3), np.array([i]), np.zeros(1),
                       np.zeros(1), np.ones(1, bool), 1.0)
            for i in range(2)
        ]  # fmt: skip
        return TrajectoryGroup(gid, trajs)


def _no_engine_actor(queue, seconds=(0.002, 0.004), **kw) -> ControlledRolloutActor:
    """An actor whose episodes are :class:`_FakeEpisodes`, ready to ``resume``."""
    a = _actor(queue, **kw)
    a.engine = FakeEngine()  # resume() only needs a started engine
    a.episodes = _FakeEpisodes(a, seconds)
    return a


class _SlowToHearQueue(ReplayQueueCore):
    """The real queue, but a given-back slot lands only after a while, as when the
    queue actor is busy: an async Ray actor may then answer a later call first."""

    abandoned = 0

    async def abandon(self, num_groups: int = 1, actor: str | None = None) -> None:
        await asyncio.sleep(0.3)
        self.abandoned += num_groups
        await super().abandon(num_groups, actor)

    def abandoned_slots(self) -> int:
        return self.abandoned


class _Host:
    """A Ray actor running one no-engine rollout actor at a time: the queue takes each
    hand-off's bundle from the actor it runs in (``take_bundle``), so the rollout
    actor must live in one, not in the test's process."""

    actor = None

    async def take_bundle(self, key: int):
        return await self.actor.take_bundle(key)

    async def run(self, queue, seconds, settings: dict, scenario):
        """``scenario(actor, queue)`` on a fresh :func:`_no_engine_actor`."""
        self.actor = _no_engine_actor(queue, seconds, **settings)
        await self.actor.introduce()  # as start() does, before the engine loads
        return await scenario(self.actor, queue)


@pytest.fixture(scope="module")
def host(ray_local):
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    h = ray_local.remote(_Host).options(num_cpus=0, max_concurrency=1000).remote()
    yield h
    ray_local.kill(h)


async def _run_300_groups(a, q):
    await a.resume()
    while a.stats.groups < 300:
        await asyncio.sleep(0.01)
    await a.halt()
    return a.get_stats(), a.episodes.peak, a.stats.groups


def test_hand_offs_ask_for_the_freed_slots(host):
    """A steady actor gets its slots back with its hand-offs (one queue call per
    hand-off, not two); never more than max_inflight_groups generate; once halt
    returns, every granted slot was either put or given back, and the queue heard it."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=1000)(_SlowToHearQueue)
    q = cls.remote(max_staleness=10**6, batch_groups=1, policy="drop", capacity_groups=10**6)
    settings = {"max_inflight_groups": 8, "handoff_linger_ms": 5}
    try:
        st, peak, groups = ray.get(host.run.remote(q, (0.002, 0.004), settings, _run_300_groups))
        qs = ray.get(q.stats.remote())
        assert st["fatal"] == "" and peak <= 8
        assert st["handoff_granted"] > 0.8 * st["handoff_groups"], st
        assert st["acquire_calls"] < st["handoff_calls"] / 4, st
        assert qs["groups_running"] == 0, qs  # nothing granted is left unaccounted
        assert ray.get(q.abandoned_slots.remote()) > 0  # halt did cancel groups
        assert qs["produced"] == 2 * st["handoff_groups"] == 2 * groups
    finally:
        ray.kill(q)


async def _until_8_produced(a, q):
    import time

    t0 = time.monotonic()
    await a.resume()
    while (await q.stats.remote())["produced"] < 8 and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.01)
    took = time.monotonic() - t0
    await a.halt()
    return a.stats.groups, a.get_stats()["handoff_groups"], took


def test_the_last_groups_before_a_shut_window_do_not_wait_out_the_linger(host):
    """Once the actor has nothing generating (the queue grants no more slots: the
    staleness window is shut, or the run's end), its finished groups go at once, not
    after actor.handoff_linger_ms: the learner may be waiting for exactly these."""
    import ray

    from asyncrl.replay.queue import remote_queue

    q = remote_queue(max_staleness=10**6, batch_groups=1, policy="drop", capacity_groups=4)
    ray.get(q.stats.remote())  # the queue's process is up: its start-up is not timed
    settings = {"max_inflight_groups": 8, "handoff_linger_ms": 5000}
    try:
        groups, handed, took = ray.get(
            host.run.remote(q, (0.002, 0.004), settings, _until_8_produced)
        )
        assert groups == 4 and handed == 4
        assert took < 2.5, took  # the linger is 5 s
    finally:
        ray.kill(q)


async def _sample_100_groups(a, q):
    import time

    held = []  # finished groups' slots that no queue call has asked for yet
    t0 = time.monotonic()
    await a.resume()
    while a.stats.groups < 100 and time.monotonic() - t0 < 10:
        # no call in flight, groups generating: any hand-off is lingering right now
        if a.slots.asking == 0 and a.slots.inflight > 0:
            held.append(a.slots.free())
        await asyncio.sleep(0.001)
    took = time.monotonic() - t0
    await a.halt()
    return a.get_stats(), took, held


def test_a_hand_off_stops_lingering_once_a_quarter_of_the_slots_wait_for_it(host):
    """Finished groups' slots are asked for again with their hand-off, so while it
    lingers the engine has that many groups fewer queued: once a quarter of the slots
    (2 of 8) wait, it goes. Sampled while no queue call is in flight, the slots held
    back number 0 or 1 (about 3.5 when each hand-off waited until none was generating).
    How long a queue call takes does not enter: groups that finish during one wait for
    it, and the sample skips that time. Groups still travel together, not one by one."""
    import ray

    from asyncrl.replay.queue import remote_queue

    q = remote_queue(max_staleness=10**6, batch_groups=1, policy="drop", capacity_groups=10**6)
    ray.get(q.stats.remote())  # the queue's process is up: its start-up is not timed
    settings = {"max_inflight_groups": 8, "handoff_linger_ms": 5000}
    try:
        st, took, held = ray.get(host.run.remote(q, (0.02, 0.08), settings, _sample_100_groups))
        assert st["fatal"] == ""
        assert took < 5.0, took  # the linger was never waited out
        assert len(held) >= 20, held
        # a group may finish in the same turn of the loop as the second one: rarely 2+
        assert sum(held) / len(held) < 1.2, (sum(held) / len(held), held)
        assert st["handoff_groups"] >= 1.5 * st["handoff_calls"], st  # still batched
    finally:
        ray.kill(q)


def test_slots_given_back_are_all_heard_and_answered_ones_are_not_kept(ray_local):
    """Many failing groups: every slot given back reaches the queue by halt(), and the
    actor keeps only the calls not yet answered (no list growing for a whole run)."""
    import ray

    from asyncrl.replay.queue import remote_queue

    q = remote_queue(max_staleness=10**6, batch_groups=1, policy="drop", capacity_groups=10**6)

    async def main():
        a = _actor(q)
        assert await q.acquire_many.remote(500, 1.0) == 500
        kept = []
        for _ in range(10):  # 10 bursts of 50 failures, each answered before the next
            for _ in range(50):
                a._give_back(q)
            kept.append(len(a._giving_back))
            await asyncio.gather(*a._giving_back)
        await a.halt()
        return a, kept

    try:
        a, kept = asyncio.run(main())
        assert max(kept) <= 64 + 50, kept  # answered calls were let go, not all 500
        assert a._giving_back == []
        assert ray.get(q.stats.remote())["groups_running"] == 0
    finally:
        ray.kill(q)


def test_halt_does_not_wait_on_a_dead_queue_for_slots_given_back(ray_local):
    """A queue that died cannot hear slots given back (they died with it): halt()
    returns at once, without raising."""
    import time

    import ray

    from asyncrl.replay.queue import remote_queue

    q = remote_queue(max_staleness=10**6, batch_groups=1, policy="drop", capacity_groups=10**6)

    async def main():
        a = _actor(q)
        assert await q.acquire_many.remote(3, 1.0) == 3
        ray.kill(q)
        for _ in range(3):
            a._give_back(q)
        t0 = time.monotonic()
        await a.halt()
        return a, time.monotonic() - t0

    a, took = asyncio.run(main())
    assert a._giving_back == [] and took < 10, took


def _completion(token_ids, logprobs, flat: bool):
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput

    steps = FlatLogprobs() if flat else []
    for pos, (t, lp) in enumerate(zip(token_ids, logprobs)):
        # the sampled token first, as vLLM lists it, then one more candidate
        steps.append({t: Logprob(lp, 2, "a"), 99 + pos: Logprob(-9.0, 1, "b")})
    return CompletionOutput(0, "12", token_ids, -1.0, steps, finish_reason="stop")


def test_flat_and_dict_logprobs_read_the_same():
    import numpy as np

    from asyncrl.engine.vllm_engine import completion_arrays

    ids, lps = [17, 23, 5], [-0.25, -1.5, -0.125]
    flat = completion_arrays(_completion(ids, lps, flat=True), 3)
    nested = completion_arrays(_completion(ids, lps, flat=False), 3)
    for a, b in zip(flat, nested):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert flat[1].tolist() == lps and flat[2].tolist() == [3, 3, 3]
    empty = completion_arrays(_completion([], [], flat=True), 0)
    assert [len(x) for x in empty] == [0, 0, 0]


def test_spans_an_engine_never_labelled_take_the_fallback_version():
    """vLLM labels spans "default" until asyncrl labels a version (the judge never does):
    those tokens take the fallback, labelled spans their version."""
    from types import SimpleNamespace as NS

    from asyncrl.engine.vllm_engine import token_versions

    spans = [NS(start=0, end=2, version="default"), NS(start=2, end=3, version="4")]
    assert token_versions(NS(weight_versions=spans), 3, 1).tolist() == [1, 1, 4]
    assert token_versions(NS(weight_versions=None), 2, 0).tolist() == [0, 0]


def test_logprobs_not_of_the_sampled_tokens_are_refused():
    from asyncrl.engine.vllm_engine import completion_arrays

    comp = _completion([17, 23], [-0.5, -0.5], flat=True)
    comp.token_ids = [17, 24]  # position 1's log-prob belongs to another token
    with pytest.raises(RuntimeError, match="sampled token"):
        completion_arrays(comp, 0)
    comp.logprobs = None  # SamplingParams.logprobs not set
    with pytest.raises(RuntimeError, match="no per-token log-probs"):
        completion_arrays(comp, 0)


def test_groups_ask_vllm_for_flat_logprobs():
    from asyncrl.engine.protocol import policy_sampling
    from asyncrl.engine.vllm_engine import vllm_params

    params = vllm_params(policy_sampling(SamplingSettings.defaults(top_k=0)))
    assert params.logprobs == 0 and params.flat_logprobs and params.detokenize is False
    assert params.top_k == -1  # off, in vLLM's terms


def test_idle_seconds_count_only_time_with_nothing_generating(monkeypatch):
    """Idle = no group generating, measured from the transitions (not a whole wait on
    the queue): 3 s before the first group, 2 s after the last, none in between."""
    import types

    import asyncrl.actor.rollout as rollout

    now = [100.0]
    monkeypatch.setattr(rollout, "time", types.SimpleNamespace(time=lambda: now[0]))

    async def main():
        q = _Queue()
        a = _actor(q, max_inflight_groups=4)
        release = asyncio.Event()

        async def one_group(prompt):
            await release.wait()

        a._one_group = one_group
        now[0] += 3.0  # waiting for slots
        a._start_groups(2)
        await asyncio.sleep(0)
        now[0] += 5.0  # generating
        assert a.get_stats()["idle_seconds"] == 3.0
        release.set()
        await asyncio.gather(*a._pending)
        await asyncio.sleep(0)  # done callbacks
        now[0] += 2.0  # idle again, counted up to now
        return a

    a = asyncio.run(main())
    assert a.slots.inflight == 0
    assert a.get_stats()["idle_seconds"] == 5.0


def test_engine_settings_reach_vllm(monkeypatch):
    """make_engine hands the settings to vLLM's engine args (the engine itself is
    replaced: it would take 25 s to start): vLLM's stats are off unless asked for."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.engine.vllm_engine import make_engine

    got = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, a: got.append(a)))
    make_engine("/some/model", EngineSettings.defaults())
    make_engine(
        "/some/model", EngineSettings.defaults(disable_log_stats=False, extra={"block_size": 32})
    )
    assert got[0].disable_log_stats is True and got[1].disable_log_stats is False
    assert got[0].logprobs_mode == "processed_logprobs" and got[1].block_size == 32


def test_prompts_go_raw_to_a_vllm_without_a_renderer():
    """An engine without vLLM's renderer API takes the raw prompt dict."""
    from asyncrl.engine.vllm_engine import prompt_renderer

    class OldEngine:
        pass

    assert prompt_renderer(OldEngine())("1+2=") == {"prompt": "1+2="}


def test_cpu_lists_parse_and_bad_ones_are_named():
    from asyncrl.utils.affinity import parse_cpu_list

    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list(1) == {1}
    assert parse_cpu_list("0,2,4-5") == {0, 2, 4, 5}
    assert parse_cpu_list([0, "2-3"]) == {0, 2, 3}
    from omegaconf import OmegaConf

    assert parse_cpu_list(OmegaConf.create({"c": [0, "2-3"]}).c) == {0, 2, 3}  # YAML list
    for bad in ("", "a", "3-1", "-1", "0,,1", []):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_engine_cores_put_the_engine_there_and_the_actor_elsewhere(monkeypatch):
    """actor.engine_cores: processes started while the engine starts run on those
    cores (and stay there); the actor's own threads move to the other cores."""
    import os
    import subprocess
    import sys

    from asyncrl.actor.placement import place_engine, place_frontend
    from asyncrl.utils.affinity import pin_tree, process_tree

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # restored afterwards
    allowed = os.sched_getaffinity(0)
    engine_core = max(allowed)
    # what vLLM spawns: an engine-core process (main thread: the scheduler; other
    # threads: its sockets) that spawns a worker process, which has threads of its own
    engine_core_proc = (
        "import subprocess, sys, threading, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', "
        "'import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "print(1, flush=True); time.sleep(30)'], stdout=subprocess.PIPE)\n"
        "worker.stdout.readline()\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    child = None
    try:
        cores = place_engine({engine_core})
        assert cores[0] == {engine_core}
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(engine_core)
        # what vLLM does next: spawn the engine's processes (they inherit the affinity)
        child = subprocess.Popen(
            [sys.executable, "-c", engine_core_proc], stdout=subprocess.PIPE, text=True
        )
        worker = int(child.stdout.readline())
        placement = place_frontend(*cores)
        frontend = allowed - {engine_core} or allowed
        assert os.sched_getaffinity(child.pid) == {engine_core}  # the scheduler's thread
        side = [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
        assert len(side) == 1
        assert os.sched_getaffinity(side[0]) == frontend  # its other threads: not
        worker_threads = [int(t) for t in os.listdir(f"/proc/{worker}/task")]
        assert len(worker_threads) == 2
        for t in worker_threads:  # a worker's threads all stay
            assert os.sched_getaffinity(t) == {engine_core}
        assert os.sched_getaffinity(0) == frontend
        assert placement["engine_cores"] == [engine_core]
        assert placement["frontend_cores"] == sorted(frontend)
        # at least the stand-in's side thread (in a full test run this process has
        # started others, such as Ray's, and their side threads count too)
        if frontend != {engine_core}:
            assert placement["engine_io_threads"] >= 1
        else:
            assert placement["engine_io_threads"] == 0
    finally:
        if child is not None:
            for p in reversed(process_tree(child.pid)):
                os.kill(p, 9)
            child.wait()
        pin_tree(os.getpid(), allowed)  # this process and all it started: every allowed core


def test_keep_off_engines_moves_every_other_thread_off_the_engines_cores():
    """wiring.keep_off_engines: the threads of processes below the driver (a local
    Ray's raylet and its workers) leave the engines' cores; a thread that may only run
    there (an engine's) has nowhere else to go and stays; the driver itself stays;
    without engine_cores nothing moves; stop_parts gives the moved threads their
    cores back (a Ray that outlives the run is not left narrowed)."""
    import os
    import subprocess
    import sys

    from asyncrl.parts import Parts
    from asyncrl.utils.affinity import pin_tree
    from asyncrl.wiring import keep_off_engines, stop_parts

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    engine_core = max(allowed)
    sleeper = (
        "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "print(1, flush=True); time.sleep(30)"
    )
    raylet_code = (  # a thread of its own and a worker with a thread of its own
        "import subprocess, sys, threading, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {sleeper!r}], stdout=subprocess.PIPE)\n"
        "w.stdout.readline()\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(30)\n"
    )

    def threads(pid):
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]

    raylet, worker = None, None
    try:
        raylet = subprocess.Popen(
            [sys.executable, "-c", raylet_code], stdout=subprocess.PIPE, text=True
        )
        worker = int(raylet.stdout.readline())
        engine_thread = threads(worker)[-1]  # as an engine's: its cores alone
        os.sched_setaffinity(engine_thread, {engine_core})

        assert keep_off_engines([{}]) == {}  # no engine_cores: nothing moves
        assert all(os.sched_getaffinity(t) == allowed for t in threads(raylet.pid))

        moved = keep_off_engines([{"engine_cores": [engine_core]}, {}])
        assert len(moved) >= 3  # at least the stand-ins' (in a full run, Ray's too)
        for t in threads(raylet.pid) + threads(worker):
            want = {engine_core} if t == engine_thread else allowed - {engine_core}
            assert os.sched_getaffinity(t) == want
            assert (t in moved) == (t != engine_thread)
        assert os.sched_getaffinity(0) == allowed  # the driver stays

        # stop_parts gives the cores back (its Ray parts are gone here: quiet)
        stop_parts(Parts(None, {}, None, None, False, moved_affinity=moved), quiet=True)
        for t in threads(raylet.pid) + threads(worker):
            want = {engine_core} if t == engine_thread else allowed
            assert os.sched_getaffinity(t) == want
    finally:
        if worker is not None:
            os.kill(worker, 9)
        if raylet is not None:
            raylet.kill()
            raylet.wait()
        pin_tree(os.getpid(), allowed)  # this process and all it started: every allowed core


def test_engine_cores_outside_the_actors_cores_are_refused():
    import os

    from asyncrl.actor.placement import place_engine
    from asyncrl.config import ConfigError

    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="actor.engine_cores"):
        place_engine({outside})
    with pytest.raises(ConfigError, match="actor.engine_cores='1-0': not a CPU list"):
        ActorSettings.defaults(engine_cores="1-0")


class _FakeEngine:
    """The engine seam (asyncrl/engine/protocol.py) at the episode: each request
    returns one completion per text of ``texts`` (ids ``[100 + i, 200 + i]``, decoding
    to text ``i``), labelled with ``version``; the first ``aborts`` requests come back
    aborted, as under a weight update with ``update_mode=abort``."""

    seed = None

    def __init__(self, texts: list[str], aborts: int = 0, version: int = 4):
        self.texts, self.aborts, self.version = texts, aborts, version
        self.requests: list[tuple] = []

    async def generate(self, prompt, sampling, request_id, salt=None):
        import numpy as np

        from asyncrl.engine.protocol import Completion, Generation

        self.requests.append((prompt, salt, sampling.n, request_id))
        comps = [
            Completion(i, np.asarray([100 + i, 200 + i], np.int32),
                       np.asarray([-0.5, -0.25], np.float32),
                       np.full(2, self.version, np.int32), "stop")
            for i in range(len(self.texts))
        ]  # fmt: skip
        if self.aborts:
            self.aborts -= 1
            comps[-1].finish_reason = "abort"
        return Generation([5, 6, 7], comps)

    def get_tokenizer(self):
        texts = {100 + i: t for i, t in enumerate(self.texts)}

        class Tok:
            def decode(self, ids, skip_special_tokens):
                return texts[ids[0]]

        return Tok()


class _FussyTask(AdditionTask):
    """A reward that fails on one answer (a user's reward must not stop the actor)."""

    def reward(self, prompt, completion):
        if completion == "boom":
            raise ValueError("boom")
        return super().reward(prompt, completion)


def test_a_single_turn_episode_is_one_generate_call_scored_per_completion():
    """One request of n samples; each completion one trajectory of the engine's ids
    and log-probs, labelled with the engine's version, all trained on, scored by the
    task (a failing reward is a recorded 0, not an exception)."""
    from asyncrl.tasks.base import Prompt

    engine = _FakeEngine(["19", "boom", "7"])
    episodes = SingleTurnEpisodes(engine, _FussyTask(), SamplingSettings.defaults(n=3), lambda: 4)
    group = asyncio.run(episodes.run_group(Prompt("12+7=", "19")))
    ts = group.trajectories
    # one request, salted with the version the weights carry (the runner's version())
    assert [r[:3] for r in engine.requests] == [("12+7=", "policy-v4", 3)]
    assert [t.response_text for t in ts] == ["19", "boom", "7"]
    assert [t.reward for t in ts] == [1.0, 0.0, 0.0]
    assert [t.error for t in ts] == ["", "ValueError: boom", ""]
    for i, t in enumerate(ts):
        assert t.group_id == group.group_id and t.traj_id == f"{group.group_id}-{i}"
        assert t.prompt_ids.tolist() == [5, 6, 7]
        assert t.response_ids.tolist() == [100 + i, 200 + i]
        assert t.behaviour_logprobs.tolist() == [-0.5, -0.25]
        assert t.versions.tolist() == [4, 4] and t.loss_mask.all()


class _Outbox:
    """The actor's outbox, recording what it was handed."""

    busy = False

    def __init__(self):
        self.groups = []

    def put(self, group, meta):
        self.groups.append((group, meta))

    def look_again(self):
        pass


def test_an_aborted_episode_is_run_again_and_counted():
    """A weight update under `abort` cut the group short: the actor runs the prompt
    again (a fresh request), hands over only the complete group, and counts it."""

    async def main():
        a = _actor(_Queue(), update_mode="abort")
        engine = _FakeEngine(["19", "boom"], aborts=2)
        a.episodes = SingleTurnEpisodes(
            engine, _FussyTask(), SamplingSettings.defaults(n=2), lambda: 0
        )
        a._outbox = _Outbox()
        a._start_groups(1)
        await asyncio.gather(*a._pending)
        return a, engine

    a, engine = asyncio.run(main())
    assert len(engine.requests) == 3 and len({r[-1] for r in engine.requests}) == 3
    ((group, meta),) = a._outbox.groups
    assert meta.traj_ids == [t.traj_id for t in group.trajectories] and meta.actor == "t"
    s = a.stats
    assert (s.regenerated, s.groups, s.trajectories, s.tokens, s.reward_errors) == (2, 1, 2, 4, 1)
    assert a.fatal == ""


def test_a_failing_episode_frees_its_slot_and_is_reported():
    class Broken:
        async def run_group(self, prompt):
            raise RuntimeError("engine gone")

    async def main():
        q = _Queue()
        a = _actor(q)
        a.episodes = Broken()
        a._start_groups(1)
        await asyncio.gather(*a._pending)
        return a, q

    a, q = asyncio.run(main())
    assert q.abandoned == 1 and a.stats.groups == 0
    assert a.fatal == "group generation failed: RuntimeError: engine gone"
