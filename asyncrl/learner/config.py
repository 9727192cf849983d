"""``learner.*`` as typed settings, checked once in the driver before Ray starts.

conf/learner/default.yaml holds the run's values; :class:`LearnerSettings`' defaults are
the same (tests/test_learner_config.py fails when they drift), so a learner built in
Python (tests, benchmarks) trains as a run's does. :class:`OptimSettings`' defaults are
the plain optimizer (constant LR, no brake); a run takes every ``learner.optim`` value
from the YAML. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import ConfigError, settings_from


class Schedule(enum.StrEnum):
    """The LR after warm-up (learner/optim.py: ``lr_factor``)."""

    CONSTANT = "constant"
    COSINE = "cosine"  # to ``min_lr_ratio`` x lr at ``total_steps``


class Normalisation(enum.StrEnum):
    """How per-token loss weights are normalised over a (mini)batch."""

    TOKEN = "token"  # every token of the batch counts alike
    SEQUENCE = "sequence"  # every sequence counts alike, its tokens share its weight


@dataclass
class OptimSettings:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global grad norm; <= 0 turns clipping off
    warmup_steps: int = 0
    schedule: Schedule = Schedule.CONSTANT
    total_steps: int | None = None  # cosine horizon; None: the run's optimizer steps
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of the base LR
    value_lr: float | None = None  # value head's base LR; None: ``lr``
    mismatch_kl_target: float | None = None  # off-policy brake (learner/optim.py); None: off

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> None:
            raise ConfigError(f"learner.optim.{key} {why}, got {getattr(self, key)!r}")

        try:
            self.schedule = Schedule(self.schedule)
        except ValueError:
            bad("schedule", f"must be one of {[x.value for x in Schedule]}")
        if self.lr <= 0:
            bad("lr", "must be > 0")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        if self.schedule is Schedule.COSINE and not self.total_steps:
            bad("total_steps", "must be set for learner.optim.schedule=cosine")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", "must be in [0, 1]")
        if self.mismatch_kl_target is not None and not self.mismatch_kl_target > 0:
            bad("mismatch_kl_target", "must be > 0 or null")
        self.betas = tuple(self.betas)


AUTOCAST = (None, "bfloat16")  # learner.autocast's values


@dataclass
class LearnerSettings:
    world_size: int = 1  # ranks: Ray actors, one FSDP group
    num_cpus: float = 1.0  # Ray CPUs per rank
    num_gpus: float = 0.0  # GPUs per rank
    num_threads: int = 1  # torch intra-op threads per rank (0: torch's default)
    batch_groups: int = 16  # groups per batch (read by the driver's loop)
    minibatches: int = 1  # optimizer steps per batch, one policy version
    micro_batch_tokens: int = 4096  # token slots per micro-batch
    pack_row_tokens: int | None = None  # packed row width; None: 8 x the longest sequence
    normalisation: Normalisation = Normalisation.TOKEN
    value_head: bool = False
    attn_implementation: str = "sdpa"
    autocast: str | None = None  # "bfloat16": forward passes under torch.autocast (fp32 weights)
    collective_timeout_s: float = 300.0  # a rank stuck this long in a collective raises
    checkpoint_every: int = 0  # read by the driver's loop
    checkpoint_keep: int = 2  # newest RUN/checkpoints/step-V kept (0: all); read by the driver
    # Custom Ray resources each rank needs besides its CPUs/GPUs: places the ranks on the
    # nodes that offer them (`ray start --resources='{"node_b": 1}'`; docs/cluster.md).
    resources: dict[str, float] | None = None
    optim: OptimSettings = field(default_factory=OptimSettings)
    advantage: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "asyncrl.losses.advantages.GroupNormalized"}
    )  # built by the driver (asyncrl.config.build)

    def __post_init__(self) -> None:
        """ConfigError naming ``learner.<key>`` for a value no rank could run with."""
        try:
            self.normalisation = Normalisation(self.normalisation)
        except ValueError:
            raise ConfigError(
                f"learner.normalisation must be one of {[n.value for n in Normalisation]}, "
                f"got {self.normalisation!r}"
            ) from None
        for key in ("world_size", "batch_groups", "micro_batch_tokens", "minibatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"learner.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_cpus <= 0:
            raise ConfigError(
                f"learner.num_cpus must be > 0 (Ray CPUs per rank), got {self.num_cpus}"
            )
        for key in ("num_gpus", "num_threads", "checkpoint_every", "checkpoint_keep"):
            if getattr(self, key) < 0:
                raise ConfigError(f"learner.{key} must be >= 0, got {getattr(self, key)}")
        if self.pack_row_tokens is not None and self.pack_row_tokens < 1:
            raise ConfigError(
                f"learner.pack_row_tokens must be >= 1 or null, got {self.pack_row_tokens}"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError(
                f"learner.collective_timeout_s must be > 0, got {self.collective_timeout_s}"
            )
        if self.autocast not in AUTOCAST:
            raise ConfigError(
                f"learner.autocast={self.autocast!r}: expected one of {list(AUTOCAST)} (null: off)"
            )
        self.resources = dict(self.resources or {})  # null: none
        check_custom_resources("learner.resources", self.resources)

    @classmethod
    def from_config(cls, node: Any, loss: Any, max_steps: int) -> LearnerSettings:
        """The ``learner`` config node, checked (keys, types, values, the loss's need for a
        value head); ``optim.total_steps`` null becomes the run's optimizer steps."""
        from omegaconf import DictConfig, OmegaConf

        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        raw = dict(raw or {})
        optim = dict(raw.get("optim") or {})
        if optim.get("total_steps") is None:  # the schedule counts optimizer steps
            mb = raw.get("minibatches", 1)
            optim["total_steps"] = max_steps * (mb if isinstance(mb, int) and mb > 0 else 1)
        raw["optim"] = optim
        s = settings_from(cls, raw, "learner")
        check_value_head(loss, s.value_head)
        return s


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
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
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
