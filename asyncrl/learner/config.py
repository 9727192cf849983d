"""``learner.*`` as typed settings, checked once in the driver before Ray starts.

conf/learner/default.yaml holds every value; :meth:`LearnerSettings.defaults` and
:meth:`OptimSettings.defaults` build them as ``asyncrl-train`` does (``total_steps`` null
becomes the run's optimizer steps), so a learner built in Python (tests, benchmarks)
trains as a run's does. Nothing here imports torch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Self

from asyncrl.config import (
    TIMEOUT_S,
    ConfigError,
    Settings,
    compose_config,
    defaults,
    merged,
    setting,
    settings_from,
)


class Schedule(enum.StrEnum):
    """The LR after warm-up (learner/optim.py: ``lr_factor``)."""

    CONSTANT = "constant"
    COSINE = "cosine"  # to ``min_lr_ratio`` x lr at ``total_steps``


class Normalisation(enum.StrEnum):
    """How per-token loss weights are normalised over a (mini)batch."""

    TOKEN = "token"  # every token of the batch counts alike
    SEQUENCE = "sequence"  # every sequence counts alike, its tokens share its weight


@dataclass
class OptimSettings(Settings):
    KEY = "learner.optim"

    lr: float = setting("> 0")
    weight_decay: float = setting(">= 0")
    betas: tuple[float, float] = setting()
    grad_clip: float = setting()  # max global grad norm; <= 0 turns clipping off
    warmup_steps: int = setting(">= 0")
    schedule: Schedule = setting()
    total_steps: int | None = setting(">= 1")  # cosine horizon; None: the run's optimizer steps
    min_lr_ratio: float = setting("[0, 1]")  # cosine floor, as a fraction of the base LR
    value_lr: float | None = setting("> 0")  # value head's base LR; None: ``lr``
    mismatch_kl_target: float | None = setting("> 0")  # off-policy brake (learner/optim.py)

    def __post_init__(self) -> None:
        super().__post_init__()

        def bad(key: str, why: str) -> None:
            raise ConfigError(f"learner.optim.{key} {why}, got {getattr(self, key)!r}")

        try:
            self.schedule = Schedule(self.schedule)
        except ValueError:
            bad("schedule", f"must be one of {[x.value for x in Schedule]}")
        if self.schedule is Schedule.COSINE and not self.total_steps:
            bad("total_steps", "must be set for learner.optim.schedule=cosine")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")

    @classmethod
    def defaults(cls, **values: Any) -> Self:
        """conf/'s ``learner.optim`` (``total_steps`` null: the CLI run's optimizer
        steps), ``values`` on top."""
        learner = fold_total_steps(defaults("learner"), compose_config().max_steps)
        return settings_from(cls, merged(cls, learner["optim"], values), cls.KEY)


@dataclass
class LoraSettings(Settings):
    """``learner.lora``: LoRA adapters on the ``targets`` linear layers of every decoder
    layer (asyncrl/learner/lora.py). ``rank`` 0 or None: off."""

    KEY = "learner.lora"

    rank: int | None = setting("[0, 4096]")  # adapter rank r; 0 / None: off
    alpha: float = setting("(0, 1e6]")  # the update is scaled by alpha / r
    dropout: float = setting("[0, 1)")  # on the adapter's input, learner only
    targets: list[str] = setting()  # HF module names (q_proj, ...), one adapter each

    def __post_init__(self) -> None:
        super().__post_init__()
        self.targets = list(self.targets)
        if self.on and (
            not self.targets or not all(isinstance(t, str) and t for t in self.targets)
        ):
            raise ConfigError(
                f"learner.lora.targets must name at least one linear layer (q_proj, ...), "
                f"got {self.targets!r}"
            )
        bad = [t for t in self.targets if t in LORA_REFUSED_TARGETS]
        if self.on and bad:
            raise ConfigError(
                f"learner.lora.targets={bad}: the embedding and the LM head take no adapter "
                f"(the engine ties and merges decoder-layer linears only)"
            )

    @property
    def on(self) -> bool:
        return bool(self.rank)

    @property
    def scale(self) -> float:
        """alpha / r: what the adapter's update is multiplied by."""
        return self.alpha / self.rank if self.rank else 0.0


LORA_REFUSED_TARGETS = ("embed_tokens", "lm_head")


@dataclass
class MoeSettings(Settings):
    """``learner.moe``: what the learner does with a mixture-of-experts model's routers
    (asyncrl/learner/routing.py)."""

    KEY = "learner.moe"

    # true: the MoE forward uses the experts recorded on the trajectory (per token, per
    # layer) instead of its own top-k, keeping the router's softmax weights for them
    routing_replay: bool = setting()


AUTOCAST = (None, "bfloat16")  # learner.autocast's values


@dataclass
class LearnerSettings(Settings):
    KEY = "learner"

    world_size: int = setting(">= 1")  # ranks: Ray actors, one FSDP group
    tp: int = setting("[1, 64]")  # tensor-parallel ranks of a data-parallel group
    ep: int = setting("[1, 64]")  # expert-parallel ranks: each holds num_experts / ep experts
    num_cpus: float = setting("> 0")  # Ray CPUs per rank
    num_gpus: float = setting(">= 0")  # GPUs per rank
    num_threads: int = setting(">= 0")  # torch intra-op threads per rank (0: torch's default)
    batch_groups: int = setting(">= 1")  # groups per batch (read by the driver's loop)
    minibatches: int = setting(">= 1")  # optimizer steps per batch, one policy version
    micro_batch_tokens: int = setting(">= 1")  # token slots per micro-batch
    pack_row_tokens: int | None = setting(">= 1")  # packed row width; None: 8 x the longest
    normalisation: Normalisation = setting()
    value_head: bool = setting()
    attn_implementation: str = setting()
    autocast: str | None = setting()  # "bfloat16": forward passes under torch.autocast
    collective_timeout_s: float = setting(TIMEOUT_S)  # a rank stuck this long raises
    checkpoint_every: int = setting(">= 0")  # read by the driver's loop
    checkpoint_keep: int = setting(">= 0")  # newest step-V kept (0: all); read by the driver
    # Custom Ray resources each rank needs besides its CPUs/GPUs: places the ranks on the
    # nodes that offer them (`ray start --resources='{"node_b": 1}'`; docs/cluster.md).
    resources: dict[str, float] | None = setting()
    lora: LoraSettings = setting()
    moe: MoeSettings = setting()
    optim: OptimSettings = setting()
    advantage: dict[str, Any] = setting()  # built by the driver (asyncrl.config.build)

    def __post_init__(self) -> None:
        """ConfigError naming ``learner.<key>`` for a value no rank could run with."""
        super().__post_init__()
        try:
            self.normalisation = Normalisation(self.normalisation)
        except ValueError:
            raise ConfigError(
                f"learner.normalisation must be one of {[n.value for n in Normalisation]}, "
                f"got {self.normalisation!r}"
            ) from None
        if self.autocast not in AUTOCAST:
            raise ConfigError(
                f"learner.autocast={self.autocast!r}: expected one of {list(AUTOCAST)} (null: off)"
            )
        if self.world_size % self.tp:
            raise ConfigError(
                f"learner.tp={self.tp} does not divide learner.world_size={self.world_size}: "
                f"the ranks form a (world_size / tp) x tp mesh"
            )
        check_ep(self.ep, self.tp, self.world_size)
        if self.lora.on and self.world_size > 1:
            raise ConfigError(
                f"learner.lora.rank={self.lora.rank} needs learner.world_size=1 (LoRA is "
                f"built and tested for one unsharded rank), got {self.world_size}"
            )
        self.resources = dict(self.resources or {})  # null: none
        check_custom_resources("learner.resources", self.resources)

    @classmethod
    def defaults(cls, **values: Any) -> Self:
        """The learner settings of ``asyncrl-train`` with no overrides (conf/, ``total_steps``
        from its ``max_steps``), ``values`` on top (``optim={"lr": 1e-2}`` merges)."""
        raw = fold_total_steps(merged(cls, defaults("learner"), values), compose_config().max_steps)
        return settings_from(cls, raw, "learner")

    @classmethod
    def from_config(cls, node: Any, loss: Any, max_steps: int) -> LearnerSettings:
        """The ``learner`` config node, checked (keys, types, values, the loss's need for a
        value head); ``optim.total_steps`` null becomes the run's optimizer steps."""
        from omegaconf import DictConfig, OmegaConf

        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        raw = fold_total_steps(dict(raw or {}), max_steps)
        s = settings_from(cls, raw, "learner")
        check_value_head(loss, s.value_head)
        return s


def check_ep(ep: int, tp: int, world_size: int) -> None:
    """``learner.ep``: 1, or a divisor of ``world_size`` (``world_size / ep`` data-parallel
    copies of the experts) that ``tp`` divides (an ``ep`` group is whole ``tp`` groups;
    experts are not split by ``tp``); the model's side is checked by learner/moe_check.py
    and learner/tensor_parallel.py."""
    if ep == 1:
        return
    if world_size % ep:
        raise ConfigError(
            f"learner.ep={ep} does not divide learner.world_size={world_size}: each rank "
            f"holds 1/ep of the experts"
        )
    if ep % tp:
        raise ConfigError(
            f"learner.ep={ep} with learner.tp={tp}: ep must be a multiple of tp (an "
            f"expert-parallel group is whole tensor-parallel groups); set learner.ep to "
            f"a multiple of {tp} dividing learner.world_size={world_size}"
        )


def fold_total_steps(raw: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """``raw`` (a ``learner`` node) with ``optim.total_steps`` null set to the run's
    optimizer steps, ``max_steps`` x ``minibatches`` (what the LR schedule counts)."""
    if isinstance(raw.get("optim"), OptimSettings):
        return raw
    optim = dict(raw.get("optim") or {})
    if optim.get("total_steps") is None:
        mb = raw.get("minibatches", 1)
        optim["total_steps"] = max_steps * (mb if isinstance(mb, int) and mb > 0 else 1)
    return {**raw, "optim": optim}


# Ray's own resources: asked for with num_cpus / num_gpus, never as custom ones.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_custom_resources(key: str, resources: Any) -> None:
    """A mapping of custom Ray resource names to amounts > 0, or a ConfigError naming ``key``."""
    for name, amount in dict(resources).items():
        if not isinstance(name, str) or not name or name in RAY_BUILTIN_RESOURCES:
            raise ConfigError(
                f"{key}: {name!r} is not a custom resource name (CPUs and GPUs come from "
                f"num_cpus / num_gpus)"
            )
        number = isinstance(amount, int | float) and not isinstance(amount, bool)
        if not number or not 0 < amount < math.inf:
            raise ConfigError(f"{key}.{name}={amount!r}: expected a number > 0")


def check_cluster_has(key: str, resources: dict[str, float], times: int) -> None:
    """Once Ray is up: every custom resource exists in the cluster, ``times`` over (else
    the placement group would wait its timeout for a node that never comes)."""
    import ray

    have = ray.cluster_resources()
    for name, amount in resources.items():
        if have.get(name, 0.0) < amount * times:
            raise ConfigError(
                f"{key}.{name}={amount:g} x {times}: the Ray cluster has {have.get(name, 0.0):g} "
                f"of {name!r}; start a node with `ray start --resources='{{\"{name}\": 1}}'` "
                f"or drop the key"
            )


def check_value_head(loss: Any, value_head: bool) -> None:
    needs = bool(loss.needs_values)
    if needs and not value_head:
        raise ConfigError(
            f"the loss ({type(loss).__name__}) needs values (needs_values=True): set "
            f"learner.value_head=true"
        )
    if value_head and not needs:
        raise ConfigError(
            f"learner.value_head=true but the loss ({type(loss).__name__}) does not use values "
            f"(needs_values=False): set learner.value_head=false"
        )
