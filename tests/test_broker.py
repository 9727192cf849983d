"""The process-group WeightBroker with real Ray, real gloo groups, the real
RolloutActor weight path and worker extension, and a fake vLLM engine at the
process boundary (it records pauses and keeps what ``reload_weights`` got).

Covers: every payload mode and rolling updates stay bit-exact across versions,
at most k actors pause at once, a killed actor is dropped within the timeout
and the others go on, a stuck actor is named and recovers, config checks.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.broker.messages import CONCURRENCY_GROUPS
from asyncrl.broker.plan import ActorView, SyncSet, plan_waves
from asyncrl.broker.settings import PAYLOAD_MODES, BrokerKind, BrokerSettings
from asyncrl.config import ConfigError
from asyncrl.engine.vllm_engine import VLLMEngine
from asyncrl.learner.weights import WeightsOut
from asyncrl.transport.delta import Mode
from asyncrl.transport.endpoint import digests
from asyncrl.transport.spec import NO_VERSION
from tests.weight_sync_controls import FaultyWorkerExtension, learner_digests, set_policy

TIMEOUT_S = 3.0
SLACK_S = 6.0  # heartbeat silence + Ray hops + scheduling on a loaded 2-core box
BUCKET_MB = 8 / 1024  # 8 KiB buckets: the small model spans many


# ----------------------------------------------------------------- pure parts
def test_plan_groups_by_held_version_and_rolls_most_stale_first():
    views = {
        "a": ActorView(loaded=3, held=3),
        "b": ActorView(loaded=3, held=3),
        "c": ActorView(loaded=1, held=1),
        "d": ActorView(loaded=2, held=NO_VERSION),
        "e": ActorView(loaded=4, held=4),
    }
    (wave,) = plan_waves(views, 4, rolling_k=0)
    assert wave == [SyncSet(("d",), NO_VERSION), SyncSet(("c",), 1), SyncSet(("a", "b"), 3)]
    waves = plan_waves(views, 4, rolling_k=2)
    assert waves == [[SyncSet(("d",), NO_VERSION), SyncSet(("c",), 1)], [SyncSet(("a", "b"), 3)]]
    assert plan_waves(views, 4, rolling_k=1, only_stale=False)[-1] == [SyncSet(("e",), 4)]
    assert plan_waves({"e": views["e"]}, 4, rolling_k=0) == []


def test_rank0_waits_the_pause_timeout_only_for_a_set_with_a_draining_member():
    """Members pause before they enter a sync; only ``wait`` (requests finish first) may
    take the pause timeout, so a dead member of any other set is named within timeout_s."""
    from asyncrl.broker.membership import Roster
    from asyncrl.broker.sync_run import SyncRun

    roster = Roster({})
    roster.views = {"a": ActorView(0), "b": ActorView(0, update_mode="wait")}
    run = SyncRun(BrokerSettings.defaults(timeout_s=5.0, pause_timeout_s=100.0), roster, None, None)
    assert run._arrive_timeout_s(("a",)) == 5.0
    assert run._arrive_timeout_s(("a", "b")) == 105.0


def test_settings_name_the_key_to_fix():
    assert PAYLOAD_MODES == tuple(m.value for m in Mode)
    ok = BrokerSettings.defaults(kind="gloo", mode="changed_buckets", rolling_k=2)
    assert ok.mode == "changed_buckets" and ok.rolling_k == 2 and ok.kind is BrokerKind.GLOO
    api = BrokerSettings.defaults(kind="gloo", mode="full", engine_api="vllm")
    assert api.engine_api == "vllm" and BrokerSettings.defaults().engine_api == "asyncrl"
    store = BrokerSettings.defaults(kind="objectstore", timeout_s=5)
    assert store.kind is BrokerKind.OBJECTSTORE and store.timeout_s == 5.0
    for bad, key in [
        ({"kind": "nope"}, "broker.kind"),
        ({"kind": "gloo", "timeout_s": "soon"}, "broker.timeout_s"),
        ({"kind": "gloo", "mode": "rolling"}, "broker.mode"),
        ({"kind": "gloo", "rolling_k": -1}, "broker.rolling_k"),
        ({"kind": "gloo", "timeout_s": 0}, "broker.timeout_s"),
        ({"kind": "gloo", "hold_copy": False, "mode": "sparse_delta"}, "broker.mode"),
        ({"kind": "gloo", "bucket_size": 1}, "bucket_size"),
        ({"kind": "gloo", "engine_api": "nope"}, "broker.engine_api"),
        ({"kind": "gloo", "engine_api": "vllm", "mode": "changed_buckets"}, "broker.engine_api"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            BrokerSettings.defaults(**bad)


def test_an_order_for_vllms_api_takes_the_engines_own_update_call():
    """``ReceiveOrder.engine_api`` picks the engine's road (asyncrl's by default), the
    version going along on vLLM's (its finish_weight_update sets it)."""
    import dataclasses

    from fake_engine import FakeEngine

    from asyncrl.actor.weights import sync_workers
    from asyncrl.broker.messages import ReceiveOrder

    eng = FakeEngine()
    order = ReceiveOrder("k", "127.0.0.1", 1, 1, 2, 3, "gloo", 5.0, 5.0, 5.0, 5.0)
    assert order.engine_api == "asyncrl"
    for api in ("vllm", "asyncrl"):
        (r,) = asyncio.run(sync_workers(eng, dataclasses.replace(order, engine_api=api)))
        assert r.ok and r.rank == 1
    assert eng.log == ["receive_via_engine:k:3", "receive:k"]


def test_objectstore_payload_travels_out_of_band(ray_local):
    """The payload pickles every tensor as an out-of-band buffer (what Ray keeps in the
    object store and maps back without a copy), unpickles as the same tensors sharing
    those buffers, and survives a real ray.put / ray.get bit-exactly, bf16 included."""
    import pickle

    import numpy as np

    from asyncrl.broker.payload import PackedWeights

    sd = {"a": torch.randn(256, 512).to(torch.bfloat16), "b": torch.arange(70_000.0)}
    packed = PackedWeights(sd.items())
    assert packed.nbytes == 256 * 512 * 2 + 70_000 * 4
    buffers: list = []
    data = pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and len(data) < 2048  # the bytes travel beside the pickle
    views = [np.frombuffer(b.raw(), np.uint8) for b in buffers]
    got = pickle.loads(data, buffers=buffers)
    assert {got[k].data_ptr() for k in sd} == {v.ctypes.data for v in views}  # no copy
    got = ray_local.get(ray_local.put(packed))
    for k, t in sd.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


class _EventEngine:
    """The pause/resume surface of AsyncLLM, recording calls (driven through the seam's
    VLLMEngine, as the actor drives a real one)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.errored = False

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.events.append(f"pause:{mode}:{clear_cache}")

    async def resume_generation(self):
        self.events.append("resume")

    async def update_weight_version(self, v):
        self.events.append(f"version:{v}")

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.events.append(f"reset_prefix:{reset_running_requests}")

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        await asyncio.sleep(3600)  # an engine core that died never answers


@pytest.mark.parametrize(
    "mode, prefix, want",
    [
        ("abort", True, ["pause:abort:True", "version:3", "resume"]),
        ("wait", False, ["pause:wait:True", "version:3", "resume"]),
        ("keep", False, ["pause:keep:False", "version:3", "resume"]),
        ("keep", True, ["pause:keep:False", "version:3", "reset_prefix:True", "resume"]),
    ],
)
async def test_paused_update_labels_the_version_and_always_resumes(mode, prefix, want):
    from asyncrl.actor import weights

    fake = _EventEngine()
    eng = VLLMEngine(fake)

    async def load():
        fake.events.append("load")
        return "loaded"

    result, paused = await weights.paused_update(eng, mode, 3, load, prefix, 5.0)
    assert result == "loaded" and paused >= 0
    assert fake.events == [want[0], "load", *want[1:]]

    async def broken():
        raise RuntimeError("reload failed")

    fake.events.clear()
    with pytest.raises(RuntimeError, match="reload failed"):
        await weights.paused_update(eng, mode, 4, broken, prefix, 5.0)
    assert fake.events == [want[0], "resume"]  # never left paused, never labelled


class _InOrderCore:
    """An engine core at the process boundary, as vLLM's behaves: a call's message is
    queued when it is sent (in the caller's first slice), messages are handled one at a
    time in order, and between them, while not paused, the engine steps (2 ms)."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.log: list[str] = []
        self.paused = False
        self._loop = asyncio.ensure_future(self._run())

    def send(self, what: str, fn=lambda: None):
        fut = asyncio.get_running_loop().create_future()
        self.inbox.put_nowait((what, fn, fut))
        return fut

    async def _run(self) -> None:
        while True:
            if self.inbox.empty() and not self.paused:
                self.log.append("step")
                await asyncio.sleep(0.002)
                continue
            what, fn, fut = await self.inbox.get()
            self.log.append(what)
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller gets it, as from vLLM
                fut.set_exception(e)

    async def pause_scheduler_async(self, mode, clear_cache):
        await self.send(f"pause:{mode}", lambda: setattr(self, "paused", True))


class _InOrderEngine:
    """AsyncLLM's update surface over :class:`_InOrderCore`."""

    errored = False

    def __init__(self, apply_fails: bool = False) -> None:
        self.engine_core = _InOrderCore()
        self.apply_fails = apply_fails

    def _apply(self):
        if self.apply_fails:
            raise RuntimeError("reload failed")
        time.sleep(0.01)
        return [{"seconds": 0.01}]

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        fn = {"asyncrl_clock": lambda: [time.monotonic()], "asyncrl_sync": self._apply}[method]
        return await self.engine_core.send(method, fn)

    async def update_weight_version(self, v):
        await self.engine_core.send(f"version:{v}")

    async def resume_generation(self):
        await self.engine_core.send("resume", lambda: setattr(self.engine_core, "paused", False))


async def test_keep_update_pipelines_its_calls_and_no_step_runs_while_paused():
    """Under keep the calls go out without awaiting each other's answers; the engine
    core still reads clock, pause, apply, label, clock, resume in that order, runs no
    step between the pause and the resume, and the engine's pause is timed by its
    clock; a failed load is never labelled and the engine always resumes."""
    from asyncrl.actor import weights

    eng = VLLMEngine(_InOrderEngine())
    await asyncio.sleep(0.01)  # the engine generates
    hops: dict[str, float] = {}
    applied, call_s = await weights.paused_update(
        eng, "keep", 3, lambda: weights.rpc(eng, "asyncrl_sync"), False, 5.0, hops=hops
    )
    assert applied == [{"seconds": 0.01}]
    log = eng.llm.engine_core.log
    msgs = [m for m in log if m != "step"]
    assert msgs == ["asyncrl_clock", "pause:keep", "asyncrl_sync", "version:3",
                    "asyncrl_clock", "resume"]  # fmt: skip
    assert "step" not in log[log.index("pause:keep") : log.index("resume")]
    assert 0.01 <= hops["engine_paused"] <= call_s
    assert set(hops) == {"load", "resume", "engine_paused"}

    eng = VLLMEngine(_InOrderEngine(apply_fails=True))
    with pytest.raises(RuntimeError, match="reload failed"):
        await weights.paused_update(eng, "keep", 4, lambda: weights.rpc(eng, "asyncrl_sync"),
                                    False, 5.0)  # fmt: skip
    msgs = [m for m in eng.llm.engine_core.log if m != "step"]
    assert msgs == ["asyncrl_clock", "pause:keep", "asyncrl_sync", "resume"]


def test_sync_tally_reports_reload_pause_and_hops():
    from asyncrl.broker.messages import Reloaded
    from asyncrl.broker.sync import SyncTally

    acc = SyncTally(version=2, t0=0.0)
    acc.t_ordered = 100.0
    for pause, reload_s, enter in ((0.05, 0.02, 100.01), (0.07, 0.03, 100.03)):
        res = Reloaded("a", 2, ok=True, pause_seconds=pause, pause_call_seconds=pause + 0.04,
                       reload_seconds=reload_s, hops={"load": reload_s + 0.01},
                       t_enter=enter, t_exit=enter + 0.2)  # fmt: skip
        acc.add_actor(res, t_back=enter + 0.21)
    m = acc.metrics(seconds=0.3, dead=0)
    assert m["broker/pause_seconds_max"] == pytest.approx(0.07)
    assert m["broker/pause_call_seconds_max"] == pytest.approx(0.11)
    assert m["broker/reload_seconds"] == pytest.approx(0.03)
    assert m["broker/hop/load_seconds"] == pytest.approx(0.04)
    assert m["broker/hop/order_seconds"] == pytest.approx(0.03)
    assert m["broker/hop/reply_seconds"] == pytest.approx(0.01)
    assert m["broker/actors_updated"] == 2


async def test_rpc_to_a_dead_engine_fails_fast():
    from asyncrl.actor import weights

    fake = _EventEngine()
    eng = VLLMEngine(fake)
    asyncio.get_running_loop().call_later(0.2, setattr, fake, "errored", True)
    t0 = time.monotonic()
    with pytest.raises(weights.EngineGone):
        await weights.rpc(eng, "asyncrl_weight_state", timeout_s=30.0)
    assert time.monotonic() - t0 < 2.0
    fake.errored = False
    with pytest.raises(TimeoutError, match="no answer within"):
        await weights.rpc(eng, "asyncrl_weight_state", timeout_s=0.3)


class _DyingEngine(_EventEngine):
    """An engine whose core dies while the pause is on its way: the call never returns
    (a dead core answers nothing) and vLLM's monitor flags ``errored`` 0.2 s later."""

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.events.append(f"pause:{mode}")
        asyncio.get_running_loop().call_later(0.2, setattr, self, "errored", True)
        await asyncio.sleep(3600)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_a_pause_to_a_dead_engine_fails_fast_not_after_the_pause_timeout(mode):
    """The weight sync that met an engine's death returns within moments (CI once waited
    the whole pause_timeout_s, 300 s, before the driver learned the engine was gone), and
    sends no resume to the dead engine."""
    from asyncrl.actor import weights

    fake = _DyingEngine()
    eng = VLLMEngine(fake)
    t0 = time.monotonic()
    with pytest.raises(weights.EngineGone, match="the pause"):
        await weights.paused_update(eng, mode, 3, lambda: asyncio.sleep(0), False, 300.0)
    assert time.monotonic() - t0 < 2.0
    assert fake.events == [f"pause:{mode}"]  # never labelled, no resume sent
    assert weights.engine_dead(eng)


# ----------------------------------------------------------------- fakes
class FakeRunner:
    """vLLM's model runner as the worker extension sees it."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.model_config = SimpleNamespace(
            dtype=torch.float32, hf_config=SimpleNamespace(tie_word_embeddings=False)
        )

    def reload_weights(self, weights_iterator) -> None:
        self.loaded = {n: t.clone() for n, t in weights_iterator}

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()


class FakeWorker(FaultyWorkerExtension):
    def __init__(self) -> None:
        self.rank = 0
        self.model_runner = FakeRunner()


class FakeEngine:
    """AsyncLLM's weight-update surface; ``events`` records (monotonic time, what). The
    worker runs its calls in another thread, as vLLM's engine core runs them in another
    process: the actor's event loop goes on meanwhile."""

    errored = False

    def __init__(self) -> None:
        self.worker = FakeWorker()
        self.events: list[tuple[float, str]] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        call = getattr(self.worker, method)
        return [await asyncio.to_thread(call, *args, **(kwargs or {}))]

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.events.append((time.monotonic(), f"pause:{mode}:{clear_cache}"))

    async def resume_generation(self):
        self.events.append((time.monotonic(), "resume"))

    async def update_weight_version(self, v):
        self.events.append((time.monotonic(), f"version:{v}"))

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.events.append((time.monotonic(), "reset_prefix"))


def _install_fake_engine(actor) -> None:
    actor.engine = VLLMEngine(FakeEngine())


def _engine_events(actor) -> list:
    return list(actor.engine.llm.events)


def _loaded_digests(actor) -> dict:
    return digests(actor.engine.llm.worker.model_runner.loaded.items())


def make_model(seed: int) -> torch.nn.ModuleDict:
    """bf16 linears (embedding and first block frozen), fp32 norms."""
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict({"embed": torch.nn.Embedding(64, 32)})
    for i in range(3):
        m[f"l{i}_q"] = torch.nn.Linear(32, 32, bias=False)
        m[f"l{i}_mlp"] = torch.nn.Linear(32, 96)
        m[f"l{i}_norm"] = torch.nn.LayerNorm(32)
    for name, mod in m.items():
        if "norm" not in name:
            mod.to(torch.bfloat16)
    for name in ("embed", "l0_q", "l0_mlp", "l0_norm"):
        m[name].requires_grad_(False)
    return m


class FakeLearner(WeightsOut):
    """A learner rank as the broker sees it: the real weight methods, on a plain
    ``model`` (the default stream: its state dict)."""

    def __init__(self, seed: int = 0) -> None:
        self.model = make_model(seed)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)

    def adamw_step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        self.opt.step()
        self.opt.zero_grad()


# ----------------------------------------------------------------- Ray fixtures
@pytest.fixture(scope="module")
def fake_world(ray_local, task):
    """Three RolloutActors (fake engines) and a fake learner rank, as Ray actors."""
    ray = ray_local
    from controlled_actor import ControlledRolloutActor, NoQueue
    from ray import cloudpickle

    from asyncrl.actor.settings import ActorSettings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cls = ray.remote(ControlledRolloutActor).options(num_cpus=0, max_concurrency=100)
    actors = {
        f"actor{i}": cls.remote(f"actor{i}", "unused", task, NoQueue(), ActorSettings.defaults(), 0)
        for i in range(3)
    }
    ray.get([a.__ray_call__.remote(_install_fake_engine) for a in actors.values()])
    learner = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(FakeLearner)
    learner = learner.options(num_cpus=0).remote()
    yield actors, learner
    for a in [*actors.values(), learner]:
        ray.kill(a)


def _start(actors, learner, **kw):
    from asyncrl.broker.client import start_weight_broker

    settings = BrokerSettings.defaults(
        bucket_mb=BUCKET_MB, timeout_s=TIMEOUT_S, join_timeout_s=30.0, verify=True, **kw
    )
    return start_weight_broker(settings, actors, [learner])


def _assert_bit_exact(ray, learner, actors) -> None:
    want = learner_digests([learner])
    for name, a in actors.items():
        assert ray.get(a.__ray_call__.remote(_loaded_digests)) == want, name


# ----------------------------------------------------------------- tests
@pytest.mark.slow
def test_every_mode_is_bit_exact_and_rolling_pauses_one_at_a_time(ray_local, fake_world):
    ray = ray_local
    actors, learner = fake_world
    broker = _start(actors, learner, mode="full")
    try:
        assert broker.actor_versions == dict.fromkeys(actors, 0)  # primed with version 0
        _assert_bit_exact(ray, learner, actors)
        seen = {}
        plan = [("full", 0), ("changed_buckets", 0), ("sparse_delta", 0), ("sparse_delta", 1)]
        for version, (mode, k) in enumerate(plan, start=1):
            set_policy(broker, mode, k)
            ray.get(learner.adamw_step.remote(version))
            t0 = time.monotonic()
            broker.publish(version)
            m = broker.wait()
            seen[(mode, k)] = (m, t0)
            assert m["broker/actors_updated"] == 3 and m["broker/errors"] == 0, broker.errors
            assert broker.actor_versions == dict.fromkeys(actors, version)
            for name in actors:
                assert m[f"broker/version/{name}"] == version
            _assert_bit_exact(ray, learner, actors)  # verify=True also checked every worker
        full, changed, sparse = (seen[(x, 0)][0] for x in PAYLOAD_MODES)
        assert full["broker/buckets_skipped"] == 0
        assert full["broker/bytes_sent"] >= full["broker/bytes_full"] > 0
        # Frozen first block: whole buckets skipped; lr 1e-6 on bf16: few elements move.
        assert changed["broker/buckets_skipped"] > 0
        assert changed["broker/bytes_sent"] < changed["broker/bytes_full"]
        assert sparse["broker/buckets_sparse"] > 0
        assert sparse["broker/bytes_sent"] < changed["broker/bytes_sent"]
        assert all(m["broker/gbps"] > 0 and m["broker/sync_seconds"] > 0 for m, _ in seen.values())
        # broker.shm=auto, every actor on this host: every set went through shared memory
        assert all(m["broker/shm_sets"] == m["broker/sets"] > 0 for m, _ in seen.values())
        # rolling_k=1: three sets, one actor each, and no two actors paused at once
        rolling, t0 = seen[("sparse_delta", 1)]
        assert rolling["broker/sets"] == 3
        spans = []
        for a in actors.values():
            ev = [(t, e) for t, e in ray.get(a.__ray_call__.remote(_engine_events)) if t >= t0]
            (pause,) = [t for t, e in ev if e.startswith("pause")]
            (resume,) = [t for t, e in ev if e == "resume"]
            assert [e for _, e in ev] == ["pause:keep:False", "version:4", "resume"]
            spans.append((pause, resume))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    finally:
        broker.close()


@pytest.mark.slow
def test_stuck_actor_is_named_within_the_timeout_and_recovers(ray_local, fake_world):
    ray = ray_local
    actors, learner = fake_world
    broker = _start(actors, learner, mode="full")  # full: bucket 1 is surely sent
    try:
        stall = 3 * TIMEOUT_S
        ray.get(actors["actor2"].inject_weight_fault.remote("stall", 1, stall))
        ray.get(learner.adamw_step.remote(100))
        broker.publish(1)
        t0 = time.monotonic()
        m = broker.wait()
        elapsed = time.monotonic() - t0
        (err,) = broker.errors
        print(err)  # shown with -rP: what an operator reads
        assert "actor 'actor2'" in err and "bucket 1" in err and "version 1" in err, err
        assert m["broker/errors"] == 1 and broker.dead == {}
        # the others were retried in a fresh group and got version 1 in the same sync
        assert broker.actor_versions == {"actor0": 1, "actor1": 1, "actor2": 0}
        assert elapsed < stall + TIMEOUT_S + SLACK_S
        time.sleep(stall)  # let the stalled worker give up on its dead group
        set_policy(broker, "sparse_delta")  # actor2 dropped its half-written copy: full anyway
        ray.get(learner.adamw_step.remote(101))
        broker.publish(2)
        m = broker.wait()
        assert broker.actor_versions == dict.fromkeys(actors, 2) and m["broker/errors"] == 0
        _assert_bit_exact(ray, learner, actors)
    finally:
        broker.close()


@pytest.mark.slow
def test_objectstore_broker_takes_the_weights_from_the_learner(ray_local, fake_world):
    """publish(V) alone: the broker asks the learner for one object-store copy, every
    actor loads exactly the learner's bytes, and the bytes are counted."""
    ray = ray_local
    from asyncrl.broker import make_broker
    from asyncrl.broker.objectstore import ObjectStoreBroker

    actors, learner = fake_world
    settings = BrokerSettings.defaults(kind="objectstore", timeout_s=60)
    broker = make_broker(settings, actors, SimpleNamespace(ranks=[learner]))
    assert isinstance(broker, ObjectStoreBroker)
    try:
        ray.get(learner.adamw_step.remote(300))
        assert broker.publish(1000) == {}
        m = broker.wait()
        want = ray.get(learner.weight_digests.remote())
        size = ray.get(learner.weights_ref.remote())["bytes"]
        assert m["broker/weights_bytes"] == size > 0
        assert m["broker/bytes_sent"] == m["broker/bytes_full"] == 3 * size
        assert broker.state()["actor_versions"] == dict.fromkeys(actors, 1000)
        for name, a in actors.items():
            assert ray.get(a.__ray_call__.remote(_loaded_digests)) == want, name
    finally:
        broker.close()


@pytest.mark.slow
def test_replaced_actor_is_primed_with_the_published_version_not_live_weights(
    ray_local, fake_world, task
):
    """A dead actor's replacement (asyncrl/fault/actors.py): remove_actor, then
    add_actor of a fresh actor under the same name while the learner has already
    stepped on. It gets the version last published, bit-exact from that snapshot (the
    learner's live weights are no longer that version), and later syncs include it."""
    ray = ray_local
    from controlled_actor import ControlledRolloutActor, NoQueue

    from asyncrl.actor.settings import ActorSettings

    actors, learner = fake_world
    broker = _start(actors, learner, mode="sparse_delta")
    cls = ray.remote(ControlledRolloutActor).options(num_cpus=0, max_concurrency=100)
    new = cls.remote("actor2", "unused", task, NoQueue(), ActorSettings.defaults(), 0)
    ray.get(new.__ray_call__.remote(_install_fake_engine))
    try:
        broker.supervise()
        ray.get(learner.adamw_step.remote(400))
        broker.publish(1)
        broker.wait()
        published = learner_digests([learner])
        broker.remove_actor("actor2", "killed (test)")
        assert broker.actor_versions == {"actor0": 1, "actor1": 1}
        ray.get(learner.adamw_step.remote(401))  # the learner trains on
        broker.add_actor("actor2", new)
        m = broker.wait()
        assert broker.actor_versions == {"actor0": 1, "actor1": 1, "actor2": 1}, broker.errors
        assert m["broker/errors"] == 0 and broker.dead == {}
        assert ray.get(new.__ray_call__.remote(_loaded_digests)) == published
        assert published != learner_digests([learner])
        broker.publish(2)
        assert broker.wait()["broker/errors"] == 0
        assert broker.actor_versions == {"actor0": 2, "actor1": 2, "actor2": 2}
        _assert_bit_exact(ray, learner, {**actors, "actor2": new})
    finally:
        broker.close()
        ray.kill(new)


@pytest.mark.slow
def test_killed_actor_is_dropped_within_the_timeout_and_the_rest_go_on(ray_local, fake_world):
    """Last in this module: it kills actor1's process."""
    ray = ray_local
    actors, learner = fake_world
    broker = _start(actors, learner, mode="full")
    try:
        ray.get(actors["actor1"].inject_weight_fault.remote("kill", 2))
        ray.get(learner.adamw_step.remote(200))
        broker.publish(1)
        t0 = time.monotonic()
        m = broker.wait()
        elapsed = time.monotonic() - t0
        assert elapsed < TIMEOUT_S + SLACK_S
        assert list(broker.dead) == ["actor1"]
        (err,) = broker.errors
        print(err)  # shown with -rP: what an operator reads
        # It dies just before posting bucket 2, with bucket 1 possibly still in flight
        # (two buckets travel at once): the sender names the one it was waiting on.
        assert re.search(r"bucket [12]\b", err), err
        assert "actor 'actor1'" in err and "version 1" in err, err
        assert m["broker/dead"] == 1 and m["broker/actors_updated"] == 2
        assert broker.actor_versions == {"actor0": 1, "actor2": 1}
        ray.get(learner.adamw_step.remote(201))
        broker.publish(2)
        assert broker.wait()["broker/errors"] == 0
        assert broker.actor_versions == {"actor0": 2, "actor2": 2}
        _assert_bit_exact(ray, learner, {n: actors[n] for n in ("actor0", "actor2")})
    finally:
        broker.close()
