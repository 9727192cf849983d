"""ActorSupervisor: a dead rollout actor (its process, or the vLLM engine under it) is
noticed within seconds, replaced under the same name, synced and generating again,
its lost work counted. It lives in the driver; nothing here blocks for an engine start.

    driver loop, each step and each BATCH_POLL_S of wait_batch: poll()
      up ──(get_stats: ActorDiedError, engine_dead, fatal)──▶ lost:
           broker.remove_actor · ray.kill + its leftover engine processes killed (and
           the /dev/shm files they had mapped removed once unmapped: utils/shm.py) ·
           queue.actor_lost (granted slots freed, counted in groups_lost; the actor's
           name gets no slot until its replacement's first weight sync)
      lost ──(restarts < fault.actor_restarts)──▶ starting: new_actor(same name, fresh
           seed) · set_rewards · start.remote()       (~25-60 s, not waited for)
      lost ──(restarts used up)──▶ dead (one warning line; with none alive: RunError)
      starting ──(start done)──▶ priming: broker.add_actor (the CURRENT version is
           synced to it in the background: weight_broker / objectstore)
      starting ──(start failed, or fault.actor_start_timeout_s)──▶ lost again
      priming ──(the actor holds the broker's version)──▶ up; its first group in the
           queue ends the recovery (recovery_seconds: detected -> that group)

Groups the dead actor had already handed to the queue stay trainable: the queue owns
their objects (replay/queue.py ``hand_over``). Their tokens carry the versions that made
them, so staleness stays honest; a fresh engine holds version 0 and is held back by
the queue until it is synced.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.fault.settings import FaultSettings
from asyncrl.utils import shm

log = logging.getLogger(__name__)

# Incarnation k of an actor whose first seed was s samples with s + k * this: a fresh,
# deterministic stream (the old one's prompts are not drawn again from the start).
RESTART_SEED_STRIDE = 1_000_003
# How long to wait for the answers of a probe, the kill and the queue/broker calls.
CALL_TIMEOUT_S = 10.0
# Errors that mean the actor's process is gone for good (ActorUnavailableError is not
# one: Ray raises it while it is still finding out).
DEAD_ERRORS = ("ActorDiedError", "RayActorError")
MAX_WHY = 160  # characters of an error kept in a log line and in summary.json
# How long the run's last clean-up waits for killed engine processes to exit and unmap
# their /dev/shm files (asyncrl/utils/shm.py); only while some are still mapped.
SHM_CLOSE_WAIT_S = 5.0


@dataclass
class Incarnation:
    """One actor name's history: its restarts and where the current attempt is."""

    name: str
    seed: int
    handle: Any = None
    state: str = "up"  # up | starting | priming | dead
    restarts: int = 0
    start_ref: Any = None
    t_started: float = 0.0
    pids: dict[str, Any] = field(default_factory=dict)  # RolloutActor.pids()
    event: dict[str, Any] | None = None  # the recovery in progress
    events: list[dict[str, Any]] = field(default_factory=list)


class ActorSupervisor:
    """``spawn(name, seed)``: a new, not yet started actor handle, its rewards set (as
    ``wiring.start_parts`` does). ``parts``: a ``asyncrl.parts.Fleet``; ``parts.actors`` holds the
    actors that are up or priming (the loop's stats and the stop see only those)."""

    def __init__(
        self, settings: FaultSettings, parts: Any, spawn: Callable[[str, int], Any],
        seeds: dict[str, int],
    ):  # fmt: skip
        self.s = settings
        self.parts = parts
        self.spawn = spawn
        self.actors = {n: Incarnation(n, seeds[n], h) for n, h in parts.actors.items()}
        self.groups_lost = 0
        self.shm = shm.Leftovers()  # what killed incarnations' processes had mapped
        parts.broker.supervise()  # no actor left is the supervisor's call, not the broker's
        for inc in self.actors.values():
            inc.pids = self._pids(inc.handle)

    # ---- the driver's calls ------------------------------------------------------------
    def poll(self, states: dict[str, Any] | None = None) -> None:
        """Look at every actor once (``states``: their get_stats answers, as
        ``loop.actor_states`` gives them; None: asked here) and move each restart on."""
        from asyncrl.loop import actor_states

        states = actor_states(self.parts) if states is None else states
        for name, st in states.items():
            inc = self.actors.get(name)
            why = death(st)
            if inc is not None and why:
                self._lost(inc, why)
            elif inc is not None and inc.state == "priming" and isinstance(st, dict):
                self._primed(inc, st)
        for inc in self.actors.values():
            if inc.state == "starting":
                self._check_start(inc)
            elif inc.state == "priming" and self._late(inc):  # its first sync failed
                self._lost(inc, f"not synced within fault.actor_start_timeout_s="
                                f"{self.s.actor_start_timeout_s:g}")  # fmt: skip
        if any(i.state != "dead" and i.event and "first_group_at" not in i.event
               for i in self.actors.values()):  # fmt: skip
            self._first_groups()
        for name in self.shm.clean():
            log.info("removed /dev/shm/%s, left by a killed actor's engine", name)

    @property
    def restarting(self) -> bool:
        return any(i.state in ("starting", "priming") for i in self.actors.values())

    def hopeless(self) -> str:
        """Why the run cannot go on ("" while some actor is up or coming back)."""
        if any(i.state != "dead" for i in self.actors.values()):
            return ""
        return (
            f"no actor is alive and none can be restarted (fault.actor_restarts="
            f"{self.s.actor_restarts} used up): "
            + "; ".join(f"{i.name}: {i.events[-1]['cause']}" for i in self.actors.values())
        )

    def metrics(self) -> dict[str, float]:
        done = [e["recovery_seconds"] for e in self.events() if "recovery_seconds" in e]
        return {
            "fault/actor_restarts": float(sum(i.restarts for i in self.actors.values())),
            "fault/actors_up": float(sum(i.state == "up" for i in self.actors.values())),
            "fault/actors_restarting": float(self.restarting),
            "fault/actor_groups_lost": float(self.groups_lost),
            "fault/actor_recovery_seconds_last": done[-1] if done else 0.0,
        }

    def events(self) -> list[dict[str, Any]]:
        return sorted((e for i in self.actors.values() for e in i.events),
                      key=lambda e: e["detected_at"])  # fmt: skip

    def summary(self, queue_stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """summary.json's ``fault`` entry (see :func:`fault_summary`)."""
        events = self.events()
        return {
            "actor_restarts": sum(i.restarts for i in self.actors.values()),
            "actor_restarts_by_actor": {n: i.restarts for n, i in self.actors.items()},
            "actors_dead": sorted(n for n, i in self.actors.items() if i.state == "dead"),
            "groups_lost": (queue_stats or {}).get("groups_lost", self.groups_lost),
            "recovery_seconds": [e["recovery_seconds"] for e in events if "recovery_seconds" in e],
            "actor_events": events,
        }

    def close(self) -> None:
        """Kill the actors still starting (the others are in ``parts.actors``: the
        caller stops them), and remove the /dev/shm files of the killed incarnations,
        waiting up to :data:`SHM_CLOSE_WAIT_S` for their processes to exit."""
        for inc in self.actors.values():
            if inc.state == "starting":
                self._kill(inc)
                inc.state = "dead"
        self.shm.clean(wait_s=SHM_CLOSE_WAIT_S)

    # ---- one death -----------------------------------------------------------------------
    def _lost(self, inc: Incarnation, why: str) -> None:
        import ray

        now = time.time()
        log.warning("actor %s is dead (%s)", inc.name, why)
        if inc.event is None or "primed_at" in inc.event:  # a new death, not a failed attempt
            inc.event = {"actor": inc.name, "cause": why, "detected_at": now}
            inc.events.append(inc.event)
        self.parts.actors.pop(inc.name, None)
        try:
            self.parts.broker.remove_actor(inc.name, why)
        except Exception as e:  # noqa: BLE001 - the broker drops it on its own anyway
            log.warning("weight broker: removing %s: %s", inc.name, e)
        self._kill(inc)
        lost = ray.get(self.parts.queue.actor_lost.remote(inc.name), timeout=CALL_TIMEOUT_S)
        self.groups_lost += lost
        inc.event["groups_lost"] = inc.event.get("groups_lost", 0) + lost
        self._restart(inc)

    def _restart(self, inc: Incarnation) -> None:
        if inc.restarts >= self.s.actor_restarts:
            inc.state = "dead"
            log.warning(
                "actor %s stays dead: fault.actor_restarts=%d used up (last: %s)",
                inc.name, self.s.actor_restarts, inc.event["cause"] if inc.event else "?",
            )  # fmt: skip
            return
        inc.restarts += 1
        seed = inc.seed + RESTART_SEED_STRIDE * inc.restarts
        log.warning("actor %s: restart %d of fault.actor_restarts=%d (seed %d)",
                    inc.name, inc.restarts, self.s.actor_restarts, seed)  # fmt: skip
        inc.handle = self.spawn(inc.name, seed)
        inc.start_ref = inc.handle.start.remote()
        inc.state, inc.t_started, inc.pids = "starting", time.time(), {}
        if inc.event is not None:
            inc.event.setdefault("attempts", 0)
            inc.event["attempts"] += 1

    def _check_start(self, inc: Incarnation) -> None:
        import ray

        ready, _ = ray.wait([inc.start_ref], timeout=0)
        if not ready:
            if self._late(inc):
                self._lost(inc, f"not started within fault.actor_start_timeout_s="
                                f"{self.s.actor_start_timeout_s:g}")  # fmt: skip
            return
        try:
            ray.get(inc.start_ref)
        except Exception as e:  # noqa: BLE001 - a failed start is a failed attempt
            self._lost(inc, f"restart failed: {type(e).__name__}: {e}")
            return
        inc.pids = self._pids(inc.handle)
        self.parts.broker.add_actor(inc.name, inc.handle)
        self.parts.actors[inc.name] = inc.handle
        inc.state = "priming"
        inc.event["up_at"] = time.time()
        if self.parts.broker.state()["version"] == 0:  # the fresh engine's weights are it
            self.parts.queue.set_weights_version.remote(inc.name, 0)

    def _late(self, inc: Incarnation) -> bool:
        """Not generating within fault.actor_start_timeout_s of its restart."""
        return time.time() - inc.t_started > self.s.actor_start_timeout_s

    def _primed(self, inc: Incarnation, st: dict[str, Any]) -> None:
        """Up once it reports a weight load (its own set_weights_version has then
        opened the queue to it), or right away while the policy is still version 0."""
        if st.get("updates", 0) > 0 or st.get("version", 0) > 0 or "primed_at" in inc.event:
            inc.state = "up"
            inc.event.setdefault("primed_at", time.time())
        elif self.parts.broker.state()["version"] == 0:
            inc.state = "up"
            inc.event["primed_at"] = time.time()

    def _first_groups(self) -> None:
        import ray

        stats = ray.get(self.parts.queue.stats.remote(), timeout=CALL_TIMEOUT_S)
        for inc in self.actors.values():
            e = inc.event
            at = stats.get("first_put_at", {}).get(inc.name)
            if e and "up_at" in e and "first_group_at" not in e and at and at > e["up_at"] - 1:
                e["first_group_at"] = at
                e["recovery_seconds"] = round(at - e["detected_at"], 2)
                log.warning("actor %s recovered: first group %.1fs after its death was seen",
                            inc.name, e["recovery_seconds"])  # fmt: skip

    # ---- processes -------------------------------------------------------------------------
    def _pids(self, handle: Any) -> dict[str, Any]:
        import ray

        try:
            return ray.get(handle.pids.remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - only used to clean up after a death
            return {}

    def _kill(self, inc: Incarnation) -> None:
        """The actor's process, then whatever of its engine outlived it (vLLM's engine
        core is not a Ray process: killing the actor leaves it running)."""
        import ray

        if inc.handle is not None:
            try:
                ray.kill(inc.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.shm.note(shm_of(inc.pids))
        kill_leftovers(inc.pids)


def shm_of(pids: dict[str, Any]) -> set[str]:
    """The /dev/shm names an incarnation's processes had mapped (``RolloutActor.pids()``'s
    ``shm``, read after its start) and those its recorded children map now; none for an
    actor on another host."""
    if not pids or pids.get("host") != os.uname().nodename:
        return set()
    return set(pids.get("shm", ())) | shm.mapped(int(p) for p in pids.get("children", {}))


def kill_leftovers(pids: dict[str, Any]) -> list[int]:
    """SIGKILL the recorded children (``RolloutActor.pids()``) still running under the
    same name on this host; returns their pids. A pid reused by another program is
    left alone (its name differs)."""
    import psutil

    if not pids or pids.get("host") != os.uname().nodename:
        return []
    killed = []
    for pid, name in pids.get("children", {}).items():
        try:
            if psutil.Process(int(pid)).name() == name:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
        except (psutil.Error, OSError):
            continue
    return killed


def death(state: Any) -> str:
    """Why an actor's get_stats answer (or the error it gave, as a string) means it is
    dead; "" if it does not."""
    if isinstance(state, str):  # Ray's message runs over many lines: its first says it
        first = state.splitlines()[0][:MAX_WHY] if state else ""
        return f"process died: {first}" if any(e in state for e in DEAD_ERRORS) else ""
    if not isinstance(state, dict):
        return ""
    if state.get("engine_dead"):
        return "vLLM engine died"
    if state.get("fatal"):
        return f"fatal: {state['fatal'][:MAX_WHY]}"
    return ""


def fault_summary(supervisor: ActorSupervisor | None, queue_stats: dict[str, Any]) -> dict:
    """summary.json's ``fault`` entry: ``actor_restarts``, ``actor_restarts_by_actor``,
    ``actors_dead``, ``groups_lost``, ``recovery_seconds`` (detected -> first group of
    the replacement, one per recovery) and ``actor_events``. ``supervisor``: the run's
    ``parts.supervisor`` (None with fault.actor_restarts=0)."""
    if supervisor is None:
        return {"actor_restarts": 0, "actor_restarts_by_actor": {}, "actors_dead": [],
                "groups_lost": queue_stats.get("groups_lost", 0), "recovery_seconds": [],
                "actor_events": []}  # fmt: skip
    return supervisor.summary(queue_stats)
