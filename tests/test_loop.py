"""asyncrl.loop.run_loop and asyncrl.wiring.stop_parts over a whole ``Parts``: the queue
and the rollout actors are small Ray actors standing in for the real ones (the process
boundary), the learner group, broker and supervisor small driver-side objects with the
methods ``asyncrl.parts`` names. The loop under test is the real one."""

from __future__ import annotations

import sys
import time

import pytest
from omegaconf import OmegaConf

from asyncrl.loop import LoopHooks, RunError, run_loop
from asyncrl.parts import Parts

pytestmark = pytest.mark.slow  # starts a local Ray

BATCH_GROUPS = 2


class Queue:
    """Hands out a batch of ``groups`` made-up refs at any version; counts what it gave."""

    def __init__(self):
        self.learner_version = 0
        self.produced = 0
        self.closed = False

    def get_batch(self, groups: int, version: int, wait_s: float) -> list[str]:
        self.produced += groups
        return [f"v{version}-g{i}" for i in range(groups)]

    def set_learner_version(self, version: int) -> None:
        self.learner_version = version

    def stats(self) -> dict:
        return {
            "depth_groups": 0,
            "produced": self.produced,
            "trained": self.produced,
            "in_flight": 0,
            "dropped_stale": 0,
            "max_staleness_trained": 0,
            "max_staleness": 2,
            "groups_lost": 0,
            "learner_version": self.learner_version,
            "closed": self.closed,
        }

    def close(self) -> None:
        self.closed = True


class Actor:
    def __init__(self):
        self.started = time.time()

    def get_stats(self) -> dict:
        return {"tokens": 100, "idle_seconds": 0.0, "started": self.started, "placement": {}}

    def stop(self) -> dict:
        return {"tokens": 100, "stopped": True}


class Learner:
    """Rewards sum to the version trained on: the loop's per-step record shows which."""

    def __init__(self):
        self.ranks: list = []
        self.trained: list[tuple[int, int]] = []  # (version, batch size)
        self.closed = False

    def submit_train_step(self, items: list, version: int):
        import ray

        self.trained.append((version, len(items)))
        return ray.put(
            {
                "reward/sum": float(version),
                "reward/count": float(len(items)),
                "reward/mean": 0.5,
                "staleness/mean": 0.0,
                "staleness/max": 0.0,
                "tokens/trained": 8.0,
                # task "a" in every step, task "b" from version 3 on
                "reward/task/a": version / 10,
                **({"reward/task/b": 1.0} if version >= 3 else {}),
            }
        )

    def ping(self) -> bool:
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        self.closed = True


class Broker:
    def __init__(self):
        self.published: list[int] = []
        self.closed = False

    def publish(self, version: int) -> dict[str, float]:
        self.published.append(version)
        return {"broker/published": float(version)}

    def wait(self) -> dict[str, float]:
        return {}

    def state(self) -> dict:
        return {"version": self.published[-1] if self.published else 0}

    def close(self) -> None:
        self.closed = True


class Supervisor:
    def __init__(self, hopeless_after: int | None = None):
        self.polls = 0
        self.hopeless_after = hopeless_after
        self.restarting = False
        self.closed = False

    def poll(self, states=None) -> None:
        self.polls += 1

    def hopeless(self) -> str:
        if self.hopeless_after is not None and self.polls > self.hopeless_after:
            return "every actor died"
        return ""

    def metrics(self) -> dict[str, float]:
        return {"fault/actors_up": 1.0}

    def close(self) -> None:
        self.closed = True


class Sink:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))


def config(max_steps: int):
    return OmegaConf.create(
        {
            "max_steps": max_steps,
            "learner": {"batch_groups": BATCH_GROUPS, "checkpoint_every": 0, "checkpoint_keep": 2},
            "replay": {"wait_timeout_s": 30.0},
        }
    )


@pytest.fixture
def parts(ray_local):
    ray = ray_local
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers lack tests/
    queue = ray.remote(num_cpus=0)(Queue).remote()
    actors = {f"actor{i}": ray.remote(num_cpus=0)(Actor).remote() for i in range(2)}
    p = Parts(
        queue=queue,
        actors=actors,
        learner=Learner(),
        broker=Broker(),
        started_ray=False,
        supervisor=Supervisor(),
    )
    yield p
    for a in [queue, *actors.values()]:
        ray.kill(a)


def test_the_loop_trains_publishes_and_logs_every_version(parts, ray_local):
    learner, broker = parts.learner, parts.broker
    sink = Sink()
    out = run_loop(config(5), parts, sink, version=2)  # resumed at 2: three steps to 5
    assert (out.steps, out.policy_version) == (3, 5)
    assert learner.trained == [(2, BATCH_GROUPS), (3, BATCH_GROUPS), (4, BATCH_GROUPS)]
    assert broker.published == [3, 4, 5]
    assert out.per_step == [(2.0, 2.0), (3.0, 2.0), (4.0, 2.0)]
    assert out.tokens_trained == 24
    assert out.per_task == {"a": [0.2, 0.3, 0.4], "b": [1.0, 1.0]}
    assert [step for step, _ in sink.logged] == [3, 4, 5]
    m = sink.logged[-1][1]
    assert m["broker/published"] == 5.0 and m["fault/actors_up"] == 1.0
    assert m["replay/produced"] == 3 * BATCH_GROUPS  # the queue's stats of the step
    assert {"perf/wait_seconds", "perf/train_seconds", "perf/publish_seconds"} <= set(m)
    assert set(out.phases) == {"wait", "train", "publish"}
    assert ray_local.get(parts.queue.stats.remote())["learner_version"] == 5
    assert parts.supervisor.polls == 6  # before each batch and before each publish


def test_the_loop_stops_when_asked_and_on_a_hopeless_supervisor(parts):
    asked = iter([False, False, True])
    out = run_loop(config(9), parts, Sink(), hooks=LoopHooks(should_stop=lambda: next(asked)))
    assert (out.steps, out.policy_version) == (2, 2)

    parts.supervisor = Supervisor(hopeless_after=1)
    with pytest.raises(RunError, match="every actor died; queue: "):
        run_loop(config(9), parts, Sink(), version=2)


def test_stop_parts_closes_every_part_and_keeps_the_accounting(parts):
    from asyncrl.wiring import stop_parts

    run_loop(config(1), parts, Sink())
    learner, broker, supervisor = parts.learner, parts.broker, parts.supervisor
    queue_stats, actor_stats = stop_parts(parts)
    assert queue_stats["produced"] == BATCH_GROUPS and queue_stats["closed"]
    assert actor_stats == {n: {"tokens": 100, "stopped": True} for n in ("actor0", "actor1")}
    assert broker.closed and learner.closed and supervisor.closed
    assert parts.broker is None and parts.actors == {} and parts.reward_workers == []
    with pytest.raises(RunError, match="broker is closed"):
        run_loop(config(2), parts, Sink(), version=1)


def test_reward_by_task_is_each_tasks_first_and_last_tenth():
    """summary.json ``reward_by_task``: per task, the mean of its per-step rewards over
    the first and the last tenth of the steps that trained it."""
    from asyncrl.train import by_task

    per = {"climb": [i / 100 for i in range(30)], "once": [0.5]}
    got = by_task(per)
    assert got["climb"] == {"first": (0.0 + 0.01 + 0.02) / 3, "last": (0.27 + 0.28 + 0.29) / 3,
                            "steps": 30}  # fmt: skip
    assert got["once"] == {"first": 0.5, "last": 0.5, "steps": 1}
    assert by_task({}) == {}
