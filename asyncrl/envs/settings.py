"""``env`` in config: which environment class runs an episode, and the episode's limits.

    env:
      _target_: my_pkg.MyEnv     # the env class (asyncrl/envs/base.py Env)
      max_turns: 4               # policy turns per episode
      max_tokens: 128            # response tokens per episode (generated + observations);
                                 #   null: actor.engine.max_model_len bounds it alone
      timeout_s: 60              # wall-clock seconds per episode
      some_arg: 3                # any other key: an argument of MyEnv(...)

Checked once in the driver before Ray starts (:meth:`EnvSettings.from_config` builds one
env through ``asyncrl.config.build``, so a bad ``_target_`` or argument names its key);
pure data afterwards, so it pickles to the actors, which build one env per episode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import ConfigError, _locate, build

LIMIT_KEYS = ("max_turns", "max_tokens", "timeout_s")
SINGLE_TURN = "asyncrl.envs.base.SingleTurnEnv"


@dataclass
class EnvSettings:
    target: str = SINGLE_TURN
    kwargs: dict[str, Any] = field(default_factory=dict)  # the env class's arguments
    max_turns: int = 1
    max_tokens: int | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ConfigError(f"env.max_turns={self.max_turns!r}: expected an integer >= 1")
        if self.max_turns < 1:
            raise ConfigError(f"env.max_turns={self.max_turns!r}: expected an integer >= 1")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ConfigError(f"env.max_tokens={self.max_tokens!r}: expected null or >= 1")
        ok = isinstance(self.timeout_s, int | float) and not isinstance(self.timeout_s, bool)
        if not ok or not self.timeout_s > 0 or math.isnan(self.timeout_s):
            raise ConfigError(f"env.timeout_s={self.timeout_s!r}: expected a number > 0")
        if self.single_turn and self.max_turns != 1:
            raise ConfigError(
                f"env.max_turns={self.max_turns}: the single-turn env has one turn; "
                "choose a multi-turn env (e.g. env=calculator)"
            )
        self._cls: type | None = None

    @property
    def single_turn(self) -> bool:
        return self.target == SINGLE_TURN

    @classmethod
    def from_config(cls, node: Any) -> EnvSettings:
        """From the ``env`` node (DictConfig, dict or None: the single-turn env). Builds
        one env to check the class and its arguments (ConfigError naming ``env.*``)."""
        from omegaconf import DictConfig, OmegaConf

        if node is None:
            return cls()
        spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        if not isinstance(spec, dict):
            raise ConfigError(f"env: expected a mapping with a _target_, got {spec!r}")
        spec = dict(spec)
        limits = {k: spec.pop(k) for k in LIMIT_KEYS if k in spec}
        out = cls(target=str(spec.get("_target_", "")), kwargs={}, **limits)
        env = build("env", spec)  # names env._target_ / env.<arg> on a mistake
        for name in ("reset", "step"):
            if not callable(getattr(env, name, None)):
                raise ConfigError(
                    f"env._target_={out.target}: has no {name}() (asyncrl/envs/base.py Env)"
                )
        out.kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        return out

    def make(self) -> Any:
        """A fresh env for one episode."""
        if self._cls is None:
            self._cls = _locate("env", self.target)
        return self._cls(**self.kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "_cls"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cls=None)
