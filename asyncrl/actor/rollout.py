"""RolloutActor: one engine (asyncrl/engine/) generating continuously into the replay queue.

    loop:  queue.acquire_many(free)  ── waits while the queue applies backpressure or
             │                           the staleness window is full (replay/buffer.py),
             │                           then grants up to `free` slots at once
           per slot: prompt = sampler.next()
           task: episodes.run_group(prompt) ─▶ outbox   (actor/episode.py)
           outbox: one queue.hand_over at a time, carrying every group finished
                   meanwhile and asking for the slots free by then; the queue takes
                   the bundle back through take_bundle (replay/outbox.py)
    update_weights() / receive_weights(): pause(mode) ─▶ reload in place ─▶ label
                   version ─▶ resume (actor/weights.py; generation is never left paused)

Up to ``max_inflight_groups`` prompts generate at once; the engine batches them.
Slots and hand-offs travel in batches because each Ray call costs about a millisecond
of CPU per side, more than generating a short group on a small machine: finished
groups wait up to ``handoff_linger_ms`` to go to the queue together (not once nothing
else is generating: no group can come along, and the learner may be waiting for
them), and the same call asks for the slots they freed (granted if the queue has them
now, never waiting). The loop itself asks, and waits, only once a quarter of
``max_inflight_groups`` is free and unasked for (at start, or while the staleness
window is shut). Under ``abort`` an episode that lost requests to a weight update
runs again from its prompt: every trajectory comes from complete generation.

Beside it: one episode (episode.py, env_runner.py; its rewards, asyncrl/rewards/),
the slots and what a hand-off tells the queue (handoff.py), placement.py, weights.py,
settings.py.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.actor import placement, weights
from asyncrl.actor.env_runner import make_runner
from asyncrl.actor.episode import EpisodeAborted, EpisodeRunner
from asyncrl.actor.handoff import Slots, group_meta
from asyncrl.actor.settings import ActorSettings
from asyncrl.broker.messages import CloseGroups, Loaded, ReceiveOrder, Reloaded, WeightState
from asyncrl.engine.backend import make_engine, warm_engine_start
from asyncrl.engine.protocol import Engine
from asyncrl.engine.vllm_engine import CONTROL_TIMEOUT_S
from asyncrl.envs.settings import EnvSettings
from asyncrl.replay.outbox import Outbox
from asyncrl.rewards.pool import RewardClient
from asyncrl.tasks.base import Prompt, Task
from asyncrl.tasks.sampler import make_sampler
from asyncrl.trajectory import TrajectoryGroup
from asyncrl.utils.affinity import parse_cpu_list

# Unanswered give-backs kept before the answered ones are let go (a long run of
# failing groups must not grow a list for the whole run).
MAX_GIVING_BACK = 64
HALT_TIMEOUT_S = 30.0  # halt(): the loop, the outbox and the given-back slots, each


@dataclass
class ActorStats:
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    reward_errors: int = 0
    regenerated: int = 0  # episodes run again after a weight update aborted them
    episode: dict[str, float] = field(default_factory=dict)  # sums of Trajectory.episode
    updates: int = 0
    update_seconds: float = 0.0
    idle_seconds: float = 0.0  # nothing generating (waiting on the queue, or halted)
    started: float = field(default_factory=lambda: time.time())  # the loop's start (start())


class RolloutActor:
    """A Ray actor (asyncrl/actor/launch.py ``new_actor``). Its remote methods: start,
    stop, get_stats, ping, sampler_state, load_sampler_state, update_weights (the
    object-store path), receive_weights (the broker's process group), weight_state,
    close_weight_groups, set_rewards, take_bundle (the queue's, at each hand-off)."""

    def __init__(
        self,
        name: str,
        model_path: str,
        task: Task,
        queue: Any,
        settings: ActorSettings,
        seed: int = 0,
        env: EnvSettings | None = None,  # None: the single-turn env
    ):
        warm_engine_start(settings.engine)  # first: its imports overlap this actor's
        self.name = name
        self.task = task
        self.env = env
        self.settings = settings
        self.update_mode = settings.update_mode
        self.version = 0
        self.stats = ActorStats()
        self._model_path, self._seed = model_path, seed
        # CPU placement (None: the OS's and vLLM's own): the engine's processes on
        # these cores, this process on the others it may use (actor/placement.py)
        cores = settings.engine_cores
        self._engine_cores = None if cores is None else parse_cpu_list(cores)
        # groups generating (started, not yet handed to the outbox), slots asked for
        self.slots = Slots(name, settings.max_inflight_groups, self._granted)
        self._idle_since: float | None = time.time()  # since when none is generating
        self._acquire_calls = 0  # the loop's own (waiting) asks; hand-offs ask too
        self._pending: set[asyncio.Task] = set()  # the group tasks
        # Slots given back to the queue and not yet confirmed: _halt() waits for them
        # (the queue is an async Ray actor, so a later call may run before them).
        self._giving_back: list[Any] = []
        self._bind(queue, seed)
        self._loop_task: asyncio.Task | None = None  # the loop, once started
        self._weights = weights.WeightUpdates(
            name, settings.engine.enable_prefix_caching, self._labelled
        )
        self.engine: Engine | None = None
        self.episodes: EpisodeRunner | None = None  # built with the engine (start())
        self.rewards = RewardClient()  # the task's reward in-process, until set_rewards
        self.rewards.on_scoring = self._scoring
        self.fatal: str = ""
        self.placement: dict[str, Any] = {}  # where engine and frontend run
        self.core_io_threads: list[int] = []  # placement.move_engine_io's ids ([]: by process)

    def _bind(self, queue: Any, seed: int) -> None:
        """Generate into ``queue``, prompts drawn from ``seed``."""
        self.queue = queue
        self.sampler = make_sampler(self.task, seed)  # uniform or adaptive (tasks/sampler.py)
        self._outbox = Outbox(queue, self.settings.handoff_linger_s, slots=self.slots)

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        # sent before the engine loads: the queue's first sight of this actor is slow
        introduced = asyncio.ensure_future(self._outbox.introduce())
        cores = placement.place_engine(self._engine_cores) if self._engine_cores else None
        self.engine = make_engine(
            self._model_path, self.settings.engine, self._seed, bool(self.settings.record_experts)
        )
        if cores is not None:
            core_io = await self.engine.call_workers("asyncrl_io_threads", None, CONTROL_TIMEOUT_S)
            self.core_io_threads = core_io[0]  # the engine core's I/O threads, where listed
            self.placement = placement.place_frontend(*cores, core_io=self.core_io_threads)
        self.episodes = make_runner(
            self.engine, self.task, self.settings, self.env, lambda: self.version, self.rewards
        )
        await self.engine.label(self.version)
        await introduced
        # the clock of idle_seconds starts with the loop, not with the engine's start-up
        self.stats.started = self._idle_since = time.time()
        self._start_loop()

    def _start_loop(self) -> None:
        self.slots.running = True
        self._loop_task = asyncio.create_task(self._generate_forever())

    async def stop(self) -> dict[str, Any]:
        await self._halt()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return self.get_stats()

    async def _halt(self) -> None:
        """Stop the generation loop, keeping the engine up: groups still generating are
        cancelled (their slots freed), groups already generated are handed over."""
        self.slots.running = False
        self.slots.freed.set()
        if self._loop_task is not None:
            done, _ = await asyncio.wait({self._loop_task}, timeout=HALT_TIMEOUT_S)
            if not done:  # stuck on a queue that does not answer: do not wait forever
                self._loop_task.cancel()
                await asyncio.wait({self._loop_task}, timeout=5)
            self._loop_task = None
        await asyncio.wait_for(self._outbox.drain(), timeout=HALT_TIMEOUT_S)
        await self._given_back(timeout_s=HALT_TIMEOUT_S)

    def _give_back(self, queue: Any, n: int = 1) -> None:
        """Tell ``queue`` that ``n`` granted slots will never be put (not awaited)."""
        self._giving_back.append(queue.abandon.remote(n, self.name))
        if len(self._giving_back) > MAX_GIVING_BACK:  # keep only the unanswered
            import ray

            _, self._giving_back = ray.wait(
                self._giving_back, num_returns=len(self._giving_back), timeout=0
            )

    async def _given_back(self, timeout_s: float) -> None:
        """Until the queue has heard every slot given back so far: after ``_halt`` its
        ``groups_running`` counts nothing of this actor's. A queue that is gone or does
        not answer within ``timeout_s`` is not waited for (its slots died with it)."""
        refs, self._giving_back = self._giving_back, []
        if refs:
            try:
                await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), timeout_s)
            except TimeoutError:
                pass

    def get_stats(self) -> dict[str, Any]:
        if self._outbox.error and not self.fatal:
            self.fatal = self._outbox.error
        s = vars(self.stats).copy()
        if self._idle_since is not None:  # idle right now: count it up to now
            s["idle_seconds"] += time.time() - max(self._idle_since, self.stats.started)
        s.update(
            name=self.name,
            version=self.version,
            inflight=self.slots.inflight,
            fatal=self.fatal,
            handoff_calls=self._outbox.calls,
            handoff_groups=self._outbox.sent_groups,
            handoff_granted=self._outbox.granted,
            acquire_calls=self._acquire_calls,
            placement=self.placement,
            pid=os.getpid(),
            # the engine's own processes died (vLLM's monitor noticed): asyncrl/fault
            engine_dead=self.engine is not None and self.engine.errored,
        )
        return s

    def pids(self) -> dict[str, Any]:
        """This process and its descendants (the vLLM engine core, its workers): pid ->
        command name, and the /dev/shm files they map (their queues: asyncrl/utils/shm.py);
        the supervisor kills what outlives the actor and removes those files, tests kill
        them."""
        import psutil

        from asyncrl.utils.shm import mapped

        me = psutil.Process()
        procs = {}
        for p in me.children(recursive=True):
            try:
                procs[p.pid] = p.name()
            except psutil.Error:  # exited meanwhile
                continue
        shm = sorted(mapped([me.pid, *procs]))
        return {"pid": me.pid, "host": os.uname().nodename, "children": procs, "shm": shm}

    def ping(self) -> str:
        return self.name

    async def take_bundle(self, key: int) -> tuple[int, list[tuple[str, bytes]]]:
        """The queue takes hand-off ``key``'s bundle (replay/outbox.py ``Outbox.take``):
        returned to the queue's call, so the queue owns the object Ray stores."""
        return await self._outbox.take(key)

    def set_rewards(self, rewards: RewardClient) -> None:
        """Score with ``rewards`` (asyncrl/rewards/pool.py); called before ``start``."""
        self.rewards = rewards
        self.rewards.on_scoring = self._scoring

    def sampler_state(self) -> dict[str, Any]:
        """Where this actor's prompt stream is (saved with a checkpoint)."""
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        """Continue the prompt stream from a checkpoint's :meth:`sampler_state`."""
        self.sampler.load_state_dict(state)

    # ---- the slot loop ---------------------------------------------------------------
    async def _generate_forever(self) -> None:
        try:
            slots = self.slots
            while slots.running:
                # Slots freed by finished groups are asked for by their hand-off; the
                # loop asks only when that is not about to happen.
                while slots.running and (slots.free() < slots.refill or self._outbox.busy):
                    slots.freed.clear()
                    await slots.freed.wait()
                if not slots.running:
                    break
                asked, granted = slots.ask(), 0
                self._acquire_calls += 1
                try:
                    granted = await self.queue.acquire_many.remote(asked, 1.0, self.name)
                finally:
                    slots.answered(asked, granted)  # starts them, or gives them back
        except Exception as e:  # the loop itself must not die silently
            self.fatal = f"{type(e).__name__}: {e}"
            raise
        finally:
            pending = list(self._pending)
            for t in pending:
                t.cancel()
            # Until every cancelled group has freed its slot (in _group_done), so none
            # is freed later on a queue bound after this loop ended.
            await asyncio.gather(*pending, return_exceptions=True)

    def _start_groups(self, n: int) -> None:
        if n and self._idle_since is not None:
            self.stats.idle_seconds += time.time() - self._idle_since
            self._idle_since = None
        for _ in range(n):
            self.slots.inflight += 1
            t = asyncio.create_task(self._one_group(self.sampler.next()))
            self._pending.add(t)
            t.add_done_callback(functools.partial(self._group_done, self.queue))
            t.add_done_callback(self._pending.discard)

    def _granted(self, n: int) -> None:
        """``n`` slots a queue call granted: start their groups, or give the slots back
        if the loop was halted meanwhile."""
        if self.slots.running and self._loop_task is not None:
            self._start_groups(n)
        else:
            self._give_back(self._outbox.queue, n)

    async def _one_group(self, prompt: Prompt) -> None:
        """Run one group's episodes and hand the group to the outbox (``slots.inflight``
        was counted up when this task started)."""
        try:
            while True:
                try:
                    group = await self.episodes.run_group(prompt)
                    break
                except EpisodeAborted:  # a weight update under `abort`: run it anew
                    self.stats.regenerated += 1
        except Exception as e:  # noqa: BLE001 - recorded (the driver reports it), not raised
            self._give_back(self.queue)  # not awaited here: the slot is freed either way
            self.fatal = f"group generation failed: {type(e).__name__}: {e}"
            return
        self._count(group)
        self.sampler.observe(prompt, [t.reward for t in group.trajectories])
        self._outbox.put(group, group_meta(group, self.name))

    def _count(self, group: TrajectoryGroup) -> None:
        ts = group.trajectories
        self.stats.groups += 1
        self.stats.trajectories += len(ts)
        self.stats.tokens += sum(len(t.response_ids) for t in ts)
        self.stats.reward_errors += sum(bool(t.error) for t in ts)
        for k, v in (kv for t in ts for kv in t.episode.items()):
            self.stats.episode[k] = self.stats.episode.get(k, 0.0) + v

    def _scoring(self, delta: int) -> None:
        """A group's scoring began (+1) or ended (-1): one generating fewer, so a
        lingering hand-off looks again."""
        if self.slots.scoring_changed(delta):
            self._outbox.look_again()

    def _group_done(self, queue: Any, task: asyncio.Task) -> None:
        """Bookkeeping of a finished group task, here and not in the task, because a
        task cancelled before it first ran never executes its own ``finally``."""
        self.slots.inflight -= 1
        if self.slots.inflight == 0:
            self._idle_since = time.time()
        if not self.slots.worth_lingering():
            self._outbox.look_again()  # the hand-off goes now
        self.slots.freed.set()
        if task.cancelled():
            self._give_back(queue)  # its slot was granted and will never be put

    # ---- weights (actor/weights.py) ---------------------------------------------------
    async def update_weights(self, ref_list: list, version: int) -> Loaded:
        """Load the state dict behind ``ref_list[0]`` (name -> tensor) as ``version``."""
        state = await ref_list[0]
        out = await self._weights.load_state_dict(
            self.engine, self.update_mode.value, state, version
        )
        self._count_update(out.seconds)
        return out

    async def receive_weights(self, order: ReceiveOrder) -> Reloaded:
        """Take part in one process-group sync (the WeightBroker's order); see
        :meth:`WeightUpdates.receive`. Never raises."""
        out = await self._weights.receive(self.engine, self.update_mode.value, order)
        if out.ok:
            self._count_update(out.seconds)
        return out

    def _count_update(self, seconds: float) -> None:
        self.stats.updates += 1
        self.stats.update_seconds += seconds

    def _labelled(self, version: int) -> None:
        """From now on the engine generates with ``version``: tell the queue, whose
        staleness window counts from the weights each actor holds (not awaited)."""
        self.version = version
        self.queue.set_weights_version.remote(self.name, version)

    async def weight_state(self) -> WeightState:
        """Loaded version, held version (min over workers) and worker count."""
        call = self.engine.weight_states(weights.RPC_TIMEOUT_S)
        states = await weights.until_answered(
            self.engine, call, weights.RPC_TIMEOUT_S, "asyncrl_weight_state"
        )
        return WeightState(
            self.name, self.version, min(s["held"] for s in states), len(states),
            self.update_mode.value, self.fatal,
        )  # fmt: skip

    async def close_weight_groups(self, order: CloseGroups) -> None:
        keys = None if order.keys is None else list(order.keys)
        call = self.engine.close_weight_groups(keys, weights.RPC_TIMEOUT_S)
        await weights.until_answered(
            self.engine, call, weights.RPC_TIMEOUT_S, "asyncrl_close_groups"
        )
