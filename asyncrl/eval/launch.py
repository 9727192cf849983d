"""Evaluation's start-up: the sets built and checked in the driver before Ray starts
(``prepare_eval``), the actor started beside the rollout engines (``launch``), stopped
at the end (``EvalRun.stop``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from asyncrl.actor.settings import ActorSettings
from asyncrl.config import ConfigError, build
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.settings import EvalSettings
from asyncrl.eval.split import TrainSplit, heldout_prompts
from asyncrl.tasks.base import Prompt

log = logging.getLogger(__name__)

# Ray calls one EvalActor serves at once: a stop or ping must not wait behind an
# evaluation that takes seconds.
MAX_CONCURRENCY = 4


@dataclass
class EvalPlan:
    settings: EvalSettings
    sets: dict[str, tuple[Any, list[Prompt]]] = field(default_factory=dict)


def prepare_eval(settings: EvalSettings, task: Any) -> tuple[EvalPlan, Any]:
    """The held-out sets (task, prompts) and the training task: ``task`` itself with
    evaluation off, else ``task`` without the held-out prompts (eval/split.py)."""
    plan = EvalPlan(settings)
    if not settings.enabled:
        return plan, task
    for name, s in settings.sets.items():
        set_task = task if s.task is None else build(f"eval.sets.{name}.task", s.task)
        try:
            prompts = heldout_prompts(set_task, settings.heldout_frac, s.seed, settings.num_prompts)
        except Exception as e:
            raise ConfigError(
                f"eval.sets.{name}: cannot draw its prompts: {type(e).__name__}: {e}"
            ) from e
        if not prompts:
            raise ConfigError(
                f"eval.sets.{name}: no held-out prompt found (eval.heldout_frac="
                f"{settings.heldout_frac}): raise it"
            )
        if len(prompts) < settings.num_prompts:
            log.info("eval.sets.%s: the held-out split has %d distinct prompts (num_prompts=%d)",
                     name, len(prompts), settings.num_prompts)  # fmt: skip
        plan.sets[name] = (set_task, prompts)
    return plan, TrainSplit(task, settings.heldout_frac)


class EvalRun:
    """The evaluation actor of one run (None-safe: a run without evaluation has none)."""

    def __init__(
        self, plan: EvalPlan, model_path: str, actor: ActorSettings, seed: int,
        env: EnvSettings | None = None,
    ):  # fmt: skip
        """``actor``: the run's ActorSettings (its engine, its limits); ``env``: the
        run's EnvSettings (an env that takes turns: each prompt runs as episodes)."""
        import ray

        from asyncrl.eval.actor import EvalActor

        s = plan.settings
        max_tokens = s.max_tokens or actor.sampling.max_tokens
        self.actor = (
            ray.remote(EvalActor)
            .options(num_cpus=s.num_cpus, max_concurrency=MAX_CONCURRENCY)
            .remote(model_path, actor, s, plan.sets, max_tokens, seed, env)
        )
        self.started = self.actor.start.remote()  # the engine starts beside the others
        self.plan = plan

    def evaluator(self, learner: Any):
        """Wait for the engine; the loop's :class:`~asyncrl.eval.driver.Evaluator`."""
        import ray

        from asyncrl.eval.driver import Evaluator

        ray.get(self.started)
        return Evaluator(self.plan.settings, self.actor, list(learner.ranks))

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - shutting down: say it, go on
            log.warning("eval actor did not stop cleanly: %s", e)
        ray.kill(self.actor, no_restart=True)


def launch(plan: EvalPlan, setup: Any) -> EvalRun | None:
    if not plan.settings.enabled:
        return None
    return EvalRun(plan, setup.model_path, setup.actor, setup.run.seed, setup.env)
