"""RolloutActor: one vLLM engine generating continuously into the replay queue.

    loop:  queue.acquire_many(free)  ── waits while the queue applies backpressure or
             │                           the staleness window is full (replay/buffer.py),
             │                           then grants up to `free` slots at once
           per slot: prompt = sampler.next()
           task: engine.generate(prompt, n samples) ─▶ score ─▶ outbox
           outbox: one ray.put + one queue.hand_over at a time, carrying every group
                   finished meanwhile and asking for the slots free by then
                   (replay/queue.py Outbox)
    update_weights(): pause(mode) ─▶ reload in place ─▶ label version ─▶ resume
                      (resume always runs: generation is never left paused)
    receive_weights(): workers receive in the background (generation goes on)
                      ─▶ pause(mode) ─▶ reload ─▶ label ─▶ resume  (actor/weights.py)

Up to ``max_inflight_groups`` prompts generate at once; the engine batches them.
Slots and hand-offs travel in batches because each Ray call costs about a millisecond
of CPU per side, more than generating a short group on a small machine: finished
groups wait up to ``handoff_linger_s`` to go to the queue together (not once nothing
else is generating: no group can come along, and the learner may be waiting for
them), and the same call asks for the slots they freed (granted if the queue has them
now, never waiting). The
loop itself asks, and waits, only once a quarter of ``max_inflight_groups`` is free and
unasked for (at start, or while the staleness window is shut).
``halt``/``rebind``/``resume`` stop the loop, point it at another queue and start it
again with the engine kept up (benchmarks reuse one engine across runs).
Under ``abort`` an in-flight group that lost samples is generated again from its
prompt, so every trajectory is produced by complete generation.
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.actor import weights
from asyncrl.actor.engine import (
    EngineSettings,
    completion_arrays,
    make_engine,
    on_cpu,
    prompt_renderer,
)
from asyncrl.replay.buffer import GroupMeta
from asyncrl.replay.queue import Outbox
from asyncrl.tasks.base import Prompt, Task, TaskSampler, score
from asyncrl.trajectory import Trajectory, TrajectoryGroup
from asyncrl.utils.affinity import children, parse_cpu_list, pin_threads, process_tree

UPDATE_MODES = ("abort", "wait", "keep")


@dataclass
class SamplingSettings:
    """``actor.sampling`` in config; the learner applies the same temperature/top-k/top-p."""

    n: int = 8  # samples per prompt (one group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 8


@dataclass
class ActorStats:
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    reward_errors: int = 0
    regenerated: int = 0
    updates: int = 0
    update_seconds: float = 0.0
    idle_seconds: float = 0.0  # nothing generating (waiting on the queue, or halted)
    started: float = field(default_factory=lambda: time.time())  # the loop's start (start())


class RolloutActor:
    def __init__(
        self,
        name: str,
        model_path: str,
        task: Task,
        queue: Any,
        sampling: SamplingSettings,
        engine: EngineSettings,
        seed: int = 0,
        max_inflight_groups: int = 256,
        update_mode: str = "keep",
        handoff_linger_s: float = 0.1,
        engine_cores: str | None = None,
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(
                f"actor.update_mode must be one of {UPDATE_MODES}, got {update_mode!r}"
            )
        self.name = name
        self.task = task
        self.queue = queue
        self.sampling = sampling
        self.sampler = TaskSampler(task, seed)
        self.update_mode = update_mode
        self.version = 0
        self.stats = ActorStats()
        self._engine_settings = engine
        self._model_path = model_path
        self._seed = seed
        if max_inflight_groups < 1:
            raise ValueError(f"actor.max_inflight_groups must be >= 1, got {max_inflight_groups}")
        if handoff_linger_s < 0:
            raise ValueError(f"actor.handoff_linger_ms must be >= 0, got {handoff_linger_s * 1000}")
        self._max_inflight = max_inflight_groups
        # Ask the queue for slots once a quarter of them are free, not one by one.
        self._refill = max(1, max_inflight_groups // 4)
        self._linger_s = handoff_linger_s
        # CPU placement (None: the OS's and vLLM's own): the engine's processes on
        # these cores, this process (its event loop: vLLM's frontend and all of the
        # actor's own work) on the others it may use
        self._engine_cores = parse_cpu_list(engine_cores) if engine_cores is not None else None
        self._n_inflight = 0  # groups generating (started, not yet handed to the outbox)
        self._idle_since: float | None = time.time()  # since when none is generating
        self._asking = 0  # slots asked for in queue calls not yet answered
        self._acquire_calls = 0  # the loop's own (waiting) asks; hand-offs ask too
        self._pending: set[asyncio.Task] = set()  # the group tasks
        # Slots given back to the queue and not yet confirmed: halt() waits for them
        # (the queue is an async Ray actor, so a later call may run before them).
        self._giving_back: list[Any] = []
        self._slot_freed = asyncio.Event()
        self._outbox = Outbox(queue, self._linger_s, slots=_HandOffSlots(self))
        self._running = False
        self._loop_task: asyncio.Task | None = None
        self._update_lock = asyncio.Lock()
        self.engine = None
        self._params = None  # vLLM SamplingParams, built on first use
        self._tokenizer = None  # the engine's, on first use
        self._render = None  # prompt text -> engine input, on first use
        self.fatal: str = ""
        self.placement: dict[str, Any] = {}  # where engine and frontend run

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        placement = self._place_engine() if self._engine_cores else None
        self.engine = make_engine(self._model_path, self._engine_settings, self._seed)
        if placement is not None:
            self._place_frontend(*placement)
        await self.engine.update_weight_version(str(self.version))
        # the clock of idle_seconds starts with the loop, not with the engine's start-up
        self.stats.started = self._idle_since = time.time()
        self._running = True
        self._loop_task = asyncio.create_task(self._generate_forever())

    def _place_engine(self) -> tuple[set[int], set[int]]:
        """Before the engine starts: this process's threads go to the engine's cores,
        so the processes vLLM spawns start there (they inherit it), and vLLM binds its
        CPU worker's OpenMP threads to them. Returns (engine cores, frontend cores)."""
        allowed = os.sched_getaffinity(0)
        engine = self._engine_cores
        if not engine <= allowed:
            raise ValueError(
                f"actor.engine_cores {sorted(engine)}: this actor may only use cores "
                f"{sorted(allowed)}"
            )
        frontend = allowed - engine or allowed  # one core: both share it
        if on_cpu():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(engine)))
        pin_threads(os.getpid(), engine)
        return engine, frontend

    def _place_frontend(self, engine: set[int], frontend: set[int]) -> None:
        """After the engine started: its processes stay on ``engine``; this process
        moves to ``frontend``, where its work no longer delays the engine's steps.

        So do the engine-core process's threads other than its main one (the
        scheduler's loop): the sockets that take requests in and send outputs out, and
        ZeroMQ's I/O. They are about an eighth of the engine's CPU, and where a new
        request arrives every millisecond or two they would keep interrupting the
        forward passes on the engine's cores. The engine-core process is the one whose
        children are the workers; a worker keeps all its threads (OpenMP's) on
        ``engine``."""
        me = os.getpid()
        for pid in process_tree(me):
            if pid != me:
                pin_threads(pid, engine)
        io_threads = self._pin_engine_io(frontend) if frontend != engine else 0
        pin_threads(me, frontend)
        self.placement = {
            "engine_cores": sorted(engine),
            "frontend_cores": sorted(frontend),
            "engine_io_threads": io_threads,  # engine-core threads moved to frontend_cores
        }

    def _pin_engine_io(self, cores: set[int]) -> int:
        """Pin the engine-core process's threads other than its main one (the
        scheduler's loop) to ``cores``; returns how many. The engine-core process is
        the child of this one whose own children are the workers."""
        return sum(
            pin_threads(pid, cores, skip_main=True)
            for pid in children(os.getpid())
            if children(pid)
        )

    async def stop(self) -> dict[str, Any]:
        await self.halt()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return self.get_stats()

    async def halt(self) -> None:
        """Stop the generation loop, keeping the engine up: groups still generating are
        cancelled (their slots freed), groups already generated are handed over."""
        self._running = False
        self._slot_freed.set()
        if self._loop_task is not None:
            done, _ = await asyncio.wait({self._loop_task}, timeout=30)
            if not done:  # stuck on a queue that does not answer: do not wait forever
                self._loop_task.cancel()
                await asyncio.wait({self._loop_task}, timeout=5)
            self._loop_task = None
        await asyncio.wait_for(self._outbox.drain(), timeout=30)
        await self._given_back(timeout_s=30)

    def _give_back(self, queue: Any, n: int = 1) -> None:
        """Tell ``queue`` that ``n`` granted slots will never be put (not awaited)."""
        self._giving_back.append(queue.abandon.remote(n))
        if len(self._giving_back) > 64:  # a long run of failing groups: keep the unanswered
            import ray

            _, self._giving_back = ray.wait(
                self._giving_back, num_returns=len(self._giving_back), timeout=0
            )

    async def _given_back(self, timeout_s: float) -> None:
        """Until the queue has heard every slot given back so far: after ``halt`` its
        ``groups_running`` counts nothing of this actor's. A queue that is gone or does
        not answer within ``timeout_s`` is not waited for (its slots died with it)."""
        refs, self._giving_back = self._giving_back, []
        if refs:
            try:
                await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), timeout_s)
            except TimeoutError:
                pass

    async def rebind(self, queue: Any, seed: int) -> None:
        """While halted: generate into ``queue`` from now on, prompts drawn afresh from
        ``seed``, counters and errors reset (the loaded weights and version stay)."""
        if self._running:
            raise RuntimeError("rebind() needs a halted actor: call halt() first")
        self.queue = queue
        self._outbox = Outbox(queue, self._linger_s, slots=_HandOffSlots(self))
        queue.set_weights_version.remote(self.name, self.version)
        self.sampler = TaskSampler(self.task, seed)
        self.stats = ActorStats()
        if self._idle_since is not None:
            self._idle_since = self.stats.started
        self._acquire_calls = 0
        self.fatal = ""

    async def resume(self) -> None:
        """Start the generation loop again after ``halt``."""
        if self.engine is None:
            raise RuntimeError("resume() needs a started actor")
        if not self._running:
            self._running = True
            self._loop_task = asyncio.create_task(self._generate_forever())

    def get_stats(self) -> dict[str, Any]:
        if self._outbox.error and not self.fatal:
            self.fatal = self._outbox.error
        s = vars(self.stats).copy()
        if self._idle_since is not None:  # idle right now: count it up to now
            s["idle_seconds"] += time.time() - max(self._idle_since, self.stats.started)
        s.update(
            name=self.name,
            version=self.version,
            inflight=self._n_inflight,
            fatal=self.fatal,
            handoff_calls=self._outbox.calls,
            handoff_groups=self._outbox.sent_groups,
            handoff_granted=self._outbox.granted,
            acquire_calls=self._acquire_calls,
            placement=self.placement,
        )
        return s

    def ping(self) -> str:
        return self.name

    def sampler_state(self) -> dict[str, Any]:
        """Where this actor's prompt stream is (saved with a checkpoint)."""
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        """Continue the prompt stream from a checkpoint's :meth:`sampler_state`."""
        self.sampler.load_state_dict(state)

    # ---- generation -----------------------------------------------------------------
    async def _generate_forever(self) -> None:
        try:
            while self._running:
                # Slots freed by finished groups are asked for by their hand-off; the
                # loop asks only when that is not about to happen.
                while self._running and (self._free() < self._refill or self._outbox.busy):
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                if not self._running:
                    break
                asked = self._ask()
                self._acquire_calls += 1
                try:
                    granted = await self.queue.acquire_many.remote(asked, 1.0, self.name)
                finally:
                    self._asking -= asked
                self._start_groups(granted)  # even if a halt came meanwhile: the
                # cancellation below frees their slots
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

    def _free(self) -> int:
        """Slots neither generating nor asked for."""
        return self._max_inflight - self._n_inflight - self._asking

    def _worth_lingering(self) -> bool:
        """Whether a hand-off may wait for more groups: some are still generating, and
        fewer than a quarter of the slots wait to be asked for again. The slots of
        finished groups are asked for with their hand-off, so each group that lingers
        is one the engine does not have queued (with 2-3-token answers a fast CPU
        engine finished about 30 groups in one 100 ms linger)."""
        return self._n_inflight > 0 and self._free() < self._refill

    def _start_groups(self, n: int) -> None:
        if n and self._idle_since is not None:
            self.stats.idle_seconds += time.time() - self._idle_since
            self._idle_since = None
        for _ in range(n):
            self._n_inflight += 1
            t = asyncio.create_task(self._one_group(self.sampler.next()))
            self._pending.add(t)
            t.add_done_callback(functools.partial(self._group_done, self.queue))
            t.add_done_callback(self._pending.discard)

    def _ask(self) -> int:
        """Reserve every free slot for one queue call (0 once halted)."""
        k = max(0, self._free()) if self._running else 0
        self._asking += k
        return k

    def _answered(self, asked: int, granted: int) -> None:
        """A hand-off's answer: start the granted groups (or give the slots back if
        the loop was halted meanwhile) and let the loop look again."""
        self._asking -= asked
        if granted and self._running and self._loop_task is not None:
            self._start_groups(granted)
        elif granted:
            self._give_back(self._outbox.queue, granted)
        self._slot_freed.set()

    async def _one_group(self, prompt: Prompt) -> None:
        """Generate one group and hand it to the outbox (``_n_inflight`` was counted
        up by the loop when it started this task)."""
        try:
            group = await self._generate_group(prompt)
        except Exception as e:  # noqa: BLE001 - recorded (the driver reports it), not raised
            self._give_back(self.queue)  # not awaited here: the slot is freed either way
            self.fatal = f"group generation failed: {type(e).__name__}: {e}"
            return
        self._outbox.put(group, _meta(group, self.name))

    def _group_done(self, queue: Any, task: asyncio.Task) -> None:
        """Bookkeeping of a finished group task, here and not in the task, because a
        task cancelled before it first ran never executes its own ``finally``."""
        self._n_inflight -= 1
        if self._n_inflight == 0:
            self._idle_since = time.time()
        if not self._worth_lingering():
            self._outbox.look_again()  # the hand-off goes now
        self._slot_freed.set()
        if task.cancelled():
            self._give_back(queue)  # its slot was granted and will never be put

    def vllm_sampling_params(self):
        """The vLLM SamplingParams of every group: n samples, the sampled token's
        log-prob (in vLLM's flat layout: a few lists per sample instead of a dict and
        an object per token), only the final output."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        # detokenize=False: vLLM's per-token incremental detokenizer and its decoding of
        # every log-prob's token cost the actor's process more CPU than all the rest of
        # a group's bookkeeping; _texts decodes each completion once instead.
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_tokens,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _generate_group(self, prompt: Prompt) -> TrajectoryGroup:
        if self._params is None:  # built once: the same for every group
            self._params = self.vllm_sampling_params()
        params, s = self._params, self.sampling
        gid = uuid.uuid4().hex[:16]
        while True:
            t_start = time.time()
            final = None
            async for out in self.engine.generate(
                self.render(prompt.text),
                params,
                request_id=gid + "-" + uuid.uuid4().hex[:6],
            ):
                final = out
            comps = final.outputs if final is not None else []
            if len(comps) == s.n and all(c.finish_reason != "abort" for c in comps):
                break
            self.stats.regenerated += 1  # aborted by a weight update: generate anew
        prompt_ids = np.asarray(final.prompt_token_ids, dtype=np.int32)  # one per group
        texts = self._texts(comps)
        trajs = []
        for i, (c, text) in enumerate(zip(comps, texts)):
            ids, lps, versions = completion_arrays(c, self.version)
            reward, breakdown, err = score(self.task, prompt, text)
            self.stats.reward_errors += bool(err)
            trajs.append(
                Trajectory(
                    traj_id=f"{gid}-{i}",
                    group_id=gid,
                    prompt_ids=prompt_ids,
                    response_ids=ids,
                    behaviour_logprobs=lps,
                    versions=versions,
                    loss_mask=np.ones(len(ids), dtype=bool),
                    reward=reward,
                    reward_breakdown=breakdown,
                    finish_reason=str(c.finish_reason),
                    error=err,
                    prompt_text=prompt.text,
                    response_text=text,
                    t_start=t_start,
                    t_end=time.time(),
                )
            )
            self.stats.tokens += len(ids)
        self.stats.groups += 1
        self.stats.trajectories += len(trajs)
        return TrajectoryGroup(gid, trajs)

    def render(self, text: str) -> Any:
        """A prompt as the engine takes it (tokenized by the engine's renderer)."""
        if self._render is None:
            self._render = prompt_renderer(self.engine)
        return self._render(text)

    def _texts(self, comps: list) -> list[str]:
        """Each completion's text, decoded here once per completion (the engine is
        asked not to detokenize): what vLLM's own detokenizer gives, specials left out."""
        if self._tokenizer is None:
            self._tokenizer = self.engine.get_tokenizer()
        return [self._tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]

    # ---- weights ---------------------------------------------------------------------
    async def update_weights(self, ref_list: list, version: int) -> dict[str, float]:
        """Load the state dict behind ``ref_list[0]`` (name -> tensor) as ``version``."""
        state = await ref_list[0]
        return await self.apply_state_dict(state, version)

    async def apply_state_dict(self, state: dict, version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        async with self._update_lock:
            t0 = time.time()
            fd, path = tempfile.mkstemp(
                prefix=f"asyncrl-{self.name}-", suffix=".safetensors", dir=_shm_dir()
            )
            os.close(fd)
            try:
                save_file({k: v.contiguous() for k, v in state.items()}, path)
                await self._paused_update(
                    version, lambda: self.engine.collective_rpc("asyncrl_load_file", args=(path,))
                )
            finally:
                os.unlink(path)
            dt = time.time() - t0
            self.stats.updates += 1
            self.stats.update_seconds += dt
            return {"seconds": dt, "version": version}

    async def _paused_update(self, version: int, load, pause_timeout_s: float = 600.0):
        result, paused = await weights.paused_update(
            self.engine,
            self.update_mode,
            version,
            load,
            self._engine_settings.enable_prefix_caching,
            pause_timeout_s,
            labelled=self._labelled,
        )
        return result, paused

    def _labelled(self, version: int) -> None:
        """From now on the engine generates with ``version``: tell the queue, whose
        staleness window counts from the weights each actor holds (not awaited)."""
        self.version = version
        if self.queue is not None:  # None: an engine driven directly (tests)
            self.queue.set_weights_version.remote(self.name, version)

    async def receive_weights(self, order: dict[str, Any]) -> dict[str, Any]:
        """Take part in one process-group sync (``order`` from the WeightBroker):
        the workers receive in the background while generation goes on, then
        generation pauses (per ``update_mode``) only for the in-place reload.
        Never raises: the result says ``ok``, or the error and whether the engine
        is ``dead``; ``held`` is the version the workers keep for deltas."""
        version = order["version"]
        out: dict[str, Any] = {"name": self.name, "version": version, "ok": False}
        async with self._update_lock:
            t0 = time.monotonic()
            try:
                states = await weights.receive_to_workers(self.engine, order)
                out["held"] = min(s["held"] for s in states)
                failed = [s for s in states if s["state"] != "done"]
                if failed:
                    out.update(error=failed[0]["error"], bucket=failed[0].get("bucket"))
                    return out
                out["transfer_seconds"] = time.monotonic() - t0
                out["bytes"] = states[0]["bytes"]
                _, out["pause_seconds"] = await self._paused_update(
                    version,
                    lambda: weights.rpc(
                        self.engine,
                        "asyncrl_apply",
                        {"with_digests": order["with_digests"]},
                        order["apply_timeout_s"],
                    ),
                    order["pause_timeout_s"],
                )
                if order["with_digests"]:
                    loaded = await weights.rpc(self.engine, "asyncrl_loaded_digests")
                    out["digests"] = [d["digests"] for d in loaded]
            except Exception as e:  # noqa: BLE001 - reported to the broker, which decides
                dead = weights.engine_dead(self.engine, e)
                out.update(error=f"{type(e).__name__}: {e}", dead=dead)
                return out
            out["ok"] = True
            out["seconds"] = time.monotonic() - t0
            self.stats.updates += 1
            self.stats.update_seconds += out["seconds"]
            return out

    async def weight_state(self) -> dict[str, Any]:
        """Loaded version, held version (min over workers) and worker count."""
        states = await weights.rpc(self.engine, "asyncrl_weight_state")
        return {
            "name": self.name,
            "version": self.version,
            "held": min(s["held"] for s in states),
            "workers": len(states),
            "update_mode": self.update_mode,
            "fatal": self.fatal,
        }

    async def close_weight_groups(self, keys: list[str] | None = None) -> None:
        await weights.rpc(self.engine, "asyncrl_close_groups", {"keys": keys})

    async def inject_weight_fault(self, kind: str, bucket: int, seconds: float = 0.0) -> list:
        """Test hook: the workers ``kill`` themselves or ``stall`` at payload ``bucket``
        of the next receive. Returns the worker pids."""
        args = {"kind": kind, "bucket": bucket, "seconds": seconds}
        return await weights.rpc(self.engine, "asyncrl_inject_fault", args)

    async def loaded_digests(self) -> list[dict[str, Any]]:
        return await weights.rpc(self.engine, "asyncrl_loaded_digests")

    def set_update_mode(self, mode: str) -> None:
        if mode not in UPDATE_MODES:
            raise ValueError(f"actor.update_mode must be one of {UPDATE_MODES}, got {mode!r}")
        self.update_mode = mode

    async def checksums(self) -> dict[str, str]:
        return (await self.engine.collective_rpc("asyncrl_checksums"))[0]


class _HandOffSlots:
    """The actor's answers to its outbox (replay/queue.py ``SlotAsker``): each hand-off
    also asks for the slots free by then. Not methods of the actor itself, which is a
    Ray actor: nobody may call these remotely."""

    def __init__(self, actor: RolloutActor):
        self.actor = actor
        self.name = actor.name

    def ask(self) -> int:
        return self.actor._ask()

    def answered(self, asked: int, granted: int) -> None:
        self.actor._answered(asked, granted)

    def outbox_idle(self) -> None:
        self.actor._slot_freed.set()  # the loop may ask for slots itself again

    def worth_lingering(self) -> bool:
        return self.actor._worth_lingering()


def _meta(group: TrajectoryGroup, actor: str) -> GroupMeta:
    ts = group.trajectories
    return GroupMeta(
        group_id=group.group_id,
        traj_ids=[t.traj_id for t in ts],
        min_versions=[t.min_version for t in ts],
        num_tokens=[t.num_tokens for t in ts],
        rewards=[t.reward for t in ts],
        actor=actor,
    )


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None
