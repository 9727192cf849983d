"""Environments: multi-turn episodes (docs/envs.md). The contract is in ``base.py``; the
runner that turns an env into trajectories is the actor's (``asyncrl/actor/env_runner.py``)."""

from asyncrl.envs.base import Env, SingleTurnEnv, StepResult
from asyncrl.envs.settings import EnvSettings

__all__ = ["Env", "EnvSettings", "SingleTurnEnv", "StepResult"]
