"""``env`` in config: which environment class runs an episode, and the episode's limits.

    env:
      _target_: my_pkg.MyEnv     # the env class (asyncrl/envs/base.py Env)
      max_turns: 4               # policy turns per episode
      max_tokens: 128            # response tokens per episode (generated + observations);
                                 #   null: actor.engine.max_model_len bounds it alone
      timeout_s: 60              # wall-clock seconds per episode
      some_arg: 3                # any other key: an argument of MyEnv(...)

An env class whose constructor takes a ``sandbox`` argument gets the actor's
:class:`asyncrl.sandbox.SandboxPool` there (``sandbox.*`` in config: ``sandbox.workers``
programs at once per actor, shared by every episode the actor runs), so its grading runs
beside generation and never on the event loop.

Checked once in the driver before Ray starts (:meth:`EnvSettings.from_config` builds one
env through ``asyncrl.config.build``, so a bad ``_target_`` or argument names its key);
pure data afterwards, so it pickles to the actors, which build one env per episode.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from asyncrl.config import TIMEOUT_S, ConfigError, Settings, build, defaults, locate_target, setting
from asyncrl.sandbox.settings import SandboxSettings

LIMIT_KEYS = ("max_turns", "max_tokens", "timeout_s")
SINGLE_TURN = "asyncrl.envs.base.SingleTurnEnv"


@dataclass
class EnvSettings(Settings):
    """``env`` (conf/env/*.yaml holds every value) and ``sandbox``."""

    KEY = "env"

    target: str = setting()  # the env class (``env._target_``)
    kwargs: dict[str, Any] = setting()  # the env class's arguments (``env``'s other keys)
    max_turns: int = setting(">= 1")
    max_tokens: int | None = setting(">= 1")
    timeout_s: float = setting(TIMEOUT_S)
    sandbox: SandboxSettings = setting()  # ``sandbox.*``

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ConfigError(f"env.max_turns={self.max_turns!r}: expected an integer >= 1")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
        ):
            raise ConfigError(f"env.max_tokens={self.max_tokens!r}: expected null or >= 1")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
            raise ConfigError(f"env.timeout_s={self.timeout_s!r}: expected a number > 0")
        super().__post_init__()
        if self.single_turn and self.max_turns != 1:
            raise ConfigError(
                f"env.max_turns={self.max_turns}: the single-turn env has one turn; "
                "choose a multi-turn env (e.g. env=calculator)"
            )
        self._cls: type | None = None
        self._pool: Any = None  # the actor's SandboxPool, built on the first env that asks

    @property
    def single_turn(self) -> bool:
        return self.target == SINGLE_TURN

    @property
    def agent(self) -> bool:
        """Whether the env is an agent program that drives its own calls (a ``run_agent``
        method: asyncrl/envs/agent.py), run by asyncrl/actor/agent_runner.py."""
        if self._cls is None:
            self._cls = locate_target("env", self.target)
        return is_agent(self._cls)

    @classmethod
    def from_config(cls, node: Any, sandbox: Any = None, task: Any = None) -> EnvSettings:
        """From the ``env`` node (DictConfig, dict or None: conf/'s env; limits it leaves
        out: conf/'s) and the ``sandbox`` node (None, or keys it leaves out: conf/'s). Builds one env to check the
        class and its arguments (ConfigError naming ``env.*`` or ``sandbox.*``), and with
        ``task`` that the env takes the run's task (:meth:`check_task`)."""
        from omegaconf import DictConfig, OmegaConf

        given = OmegaConf.to_container(sandbox) if isinstance(sandbox, DictConfig) else sandbox
        box = SandboxSettings.defaults(**(given or {}))  # keys left out: conf/'s
        if node is None:
            return cls.defaults(sandbox=box)
        spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        if not isinstance(spec, dict):
            raise ConfigError(f"env: expected a mapping with a _target_, got {spec!r}")
        spec = dict(spec)
        if "sandbox" in spec:
            raise ConfigError(
                "env.sandbox: the runner passes the actor's sandbox pool; set sandbox.* instead"
            )
        if any(k not in spec for k in LIMIT_KEYS):  # a node written in Python: conf/'s env
            spec = {**{k: v for k, v in defaults("env").items() if k in LIMIT_KEYS}, **spec}
        limits = {k: spec.pop(k) for k in LIMIT_KEYS}
        out = cls(target=str(spec.get("_target_", "")), kwargs={}, sandbox=box, **limits)
        env = build("env", spec)  # names env._target_ / env.<arg> on a mistake
        own_loop = callable(getattr(env, "episodes", None))  # drives its own turns
        needs = ("run_agent",) if is_agent(type(env)) else ("reset", "step")
        for name in () if own_loop else needs:
            if not callable(getattr(env, name, None)):
                raise ConfigError(
                    f"env._target_={out.target}: has no {name}() (asyncrl/envs/base.py Env)"
                )
        out.kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        if takes_sandbox(type(env)):
            _check_isolation(box)
        if task is not None:
            out.check_task(task)
        return out

    @classmethod
    def defaults(cls, **values: Any) -> Self:
        """The env settings of ``asyncrl-train`` with no overrides (conf/'s ``env`` and
        ``sandbox``), fields in ``values`` replaced (``sandbox`` may be a mapping of
        ``sandbox.*`` values). Builds no env (:meth:`from_config` checks one)."""
        node = defaults("env")
        box = values.pop("sandbox", None)
        if not isinstance(box, SandboxSettings):
            box = SandboxSettings.defaults(**dict(box or {}))
        fields = {
            "target": node.pop("_target_"),
            **{k: node.pop(k) for k in LIMIT_KEYS},
            "kwargs": node,
            "sandbox": box,
        }
        return cls(**{**fields, **values})

    def check_task(self, task: Any) -> None:
        """An env made for one kind of task (a ``check_task(task)`` static method that
        raises ValueError) with the run's task: ConfigError naming ``env._target_``."""
        check = getattr(locate_target("env", self.target), "check_task", None)
        if not callable(check):
            return
        try:
            check(task)
        except ValueError as e:
            raise ConfigError(f"env._target_={self.target}: {e}") from None

    def check_template(self, model_path: str) -> None:
        """A message-level env (asyncrl/envs/messages.py ChatEnv) with the model: its
        chat template must render the env's messages append-only (``env.turn_split``
        history) or at least render them, and an env that ``shows_images`` needs a model
        whose processor takes images and a template that renders an image part as its
        placeholder (ConfigError naming the model and the keys)."""
        from asyncrl.envs.messages import is_chat_env

        if not is_chat_env(locate_target("env", self.target)):
            return
        from transformers import AutoTokenizer

        from asyncrl.envs.chat_turns import ChatRenderer
        from asyncrl.models.resolve import image_processor

        env, placeholder = self.make(), None
        if env.shows_images:
            try:
                placeholder = str(image_processor(model_path).image_token)
            except ValueError as e:
                raise ConfigError(
                    f"env._target_={self.target} shows images in its messages, and {e}: "
                    "set model=tiny_vlm or model.path to a vision-language model"
                ) from None
        tok = AutoTokenizer.from_pretrained(model_path)
        try:
            ChatRenderer(tok, env.chat, model_path, placeholder)
        except ValueError as e:
            raise ConfigError(f"env._target_={self.target}: {e}") from None

    def make(self) -> Any:
        """A fresh env for one episode (with the sandbox pool if it takes one)."""
        if self._cls is None:
            self._cls = locate_target("env", self.target)
        if takes_sandbox(self._cls):
            return self._cls(**self.kwargs, sandbox=self.pool())
        return self._cls(**self.kwargs)

    def prepare(self) -> None:
        """Build what every episode shares before the first one runs (the runner calls it
        when the actor starts): the sandbox pool, whose set-up probes the kernel once, a
        blocking call that must not stall the first episodes' event loop."""
        if self._cls is None:
            self._cls = locate_target("env", self.target)
        if takes_sandbox(self._cls):
            self.pool()

    def pool(self) -> Any:
        """This process's SandboxPool of ``sandbox.workers`` (built once, on first use:
        in the actor, never in the driver, which only checks the settings)."""
        if self._pool is None:
            from asyncrl.sandbox.pool import SandboxPool

            self._pool = SandboxPool(self.sandbox)
        return self._pool

    def close(self) -> None:
        """Stop the sandbox pool's threads (after its gradings in flight end)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("_cls", "_pool")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cls=None, _pool=None)


def is_agent(cls: type) -> bool:
    """Whether ``cls`` runs a black-box agent (``run_agent``) instead of ``reset``/``step``."""
    return callable(getattr(cls, "run_agent", None))


def takes_sandbox(cls: type) -> bool:
    """Whether ``cls(...)`` takes the actor's sandbox pool (a ``sandbox`` parameter)."""
    try:
        return "sandbox" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a class without an inspectable signature
        return False


def _check_isolation(box: SandboxSettings) -> None:
    """An env that grades programs needs the isolation ``sandbox.isolation`` asks for:
    refused at start-up (ConfigError naming the key), not in the first episode; with
    ``none`` it warns (docs/sandbox.md: what each machine allows)."""
    from asyncrl.sandbox.isolation import require

    require(box)


@dataclass(frozen=True)
class OpenEnvSettings(Settings):
    """``env=openenv``'s own keys (conf/env/openenv.yaml holds every value): which OpenEnv
    server to run, how many, and how its observations and actions map to text
    (asyncrl/envs/openenv_env.py)."""

    KEY: ClassVar[str] = "env"
    PRESET: ClassVar[tuple[str, ...]] = ("env=openenv",)

    server: str = setting()  # ``module`` or ``module:attr``: the server's ASGI app (``app``)
    servers: int = setting("[1, 64]")  # server processes per actor
    sessions_per_server: int = setting("[1, 1024]")  # episodes at once on each server
    action_key: str = setting()  # the action field the policy's text fills
    observation_key: str = setting()  # the observation field shown as text ("": all, JSON)
    start_timeout_s: float = setting(TIMEOUT_S)  # a server not healthy by then: env_error
    step_timeout_s: float = setting(TIMEOUT_S)  # a reset or step slower than this: env_error

    def check(self) -> None:
        super().check()
        module, _, attr = self.server.partition(":")
        if self.server and (
            not all(p.isidentifier() for p in module.split("."))
            or (attr and not attr.isidentifier())
        ):
            raise ConfigError(
                f"env.server={self.server!r}: expected a module with an OpenEnv app, "
                "`pkg.module` or `pkg.module:app` (e.g. built by openenv's create_app)"
            )
        if not self.action_key:
            raise ConfigError("env.action_key: expected the action field the text fills")


@dataclass(frozen=True)
class VisualRetrySettings(Settings):
    """``env=visual_addition_mt``'s own keys (conf/env/visual_addition_mt.yaml holds every
    value): how often a wrong answer is shown the sum again, and what a late right answer
    earns (asyncrl/envs/visual.py)."""

    KEY: ClassVar[str] = "env"
    PRESET: ClassVar[tuple[str, ...]] = ("env=visual_addition_mt",)

    retries: int = setting("[1, 8]")  # wrong answers shown a fresh image before the end
    retry_credit: float = setting("[0, 1]")  # a right answer after k retries earns this**k
