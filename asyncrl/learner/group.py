"""LearnerGroup: N learner ranks on Ray, driven like one learner.

    driver ──group.train_step.remote(items, V)──▶ rank 0 … rank N-1 (same call, same args)
                 ◀── rank 0's ObjectRef ──────── rank 0 gathers every rank's metrics
    ranks: one Ray actor each, one bundle each of a placement group (PACK), one
           torch.distributed group (gloo on CPU, NCCL on GPU) rendezvousing at an address
           the driver picks (127.0.0.1 and a free port when the group sits on its node)

The driver-facing methods of :class:`~asyncrl.learner.learner.Learner` (``train_step``,
``step_on_batch``, ``state_dict_ref``, ``logprobs_of``, ``save``, ``load``, ``ping``,
``close``) are here under the same names. ``group.m.remote(*args)`` returns an
ObjectRef, as for a plain Ray actor, so the driver code is the same for one rank or
many; ``group.m(*args)`` waits and returns rank 0's value, raising the first rank's
error as soon as any rank fails. Hot-path methods return rank 0's ref at once; a peer
that fails there surfaces as rank 0's collective timing out
(``learner.collective_timeout_s``) or at the next call. ``group.ranks`` are the rank
actors (for ``__ray_call__`` by the weight broker; rank 0 holds the full weights' stream).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from asyncrl.config import ConfigError

PLACEMENT_TIMEOUT_S = 60.0  # a placement group not ready by then will not become ready
CALL_TIMEOUT_S = 3600.0  # waiting on every rank (save, load, ping): generous, not forever
STREAM_BACKPRESSURE = 4  # weight tensors buffered ahead of the consumer, per stream

ASYNC_METHODS = ("train_step", "step_on_batch", "state_dict_ref")
SYNC_METHODS = ("logprobs_of", "save", "load", "ping")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _remote_rendezvous() -> str:
    import ray

    ip = ray.util.get_node_ip_address()
    return f"{ip}:{free_port(ip)}"


def wait_all(refs: list, timeout_s: float = CALL_TIMEOUT_S) -> list:
    """Every ref's value; raises the first error as soon as it is known."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"learner ranks did not answer within {timeout_s:g} s")
        ray.get(ready)  # raises a rank's exception at once
    return ray.get(refs)


def check_fits(world_size: int, num_cpus: float, num_gpus: float) -> None:
    """Fail at once, with the numbers, when the cluster can never hold the ranks."""
    import ray

    have = ray.cluster_resources()
    cpu, gpu = have.get("CPU", 0.0), have.get("GPU", 0.0)
    if world_size * num_cpus > cpu or world_size * num_gpus > gpu:
        raise ConfigError(
            f"learner.world_size={world_size} ranks x (learner.num_cpus={num_cpus:g}, "
            f"learner.num_gpus={num_gpus:g}) need {world_size * num_cpus:g} CPUs and "
            f"{world_size * num_gpus:g} GPUs; the Ray cluster has {cpu:g} CPUs and {gpu:g} GPUs. "
            f"Lower learner.world_size or the per-rank resources, or add nodes"
        )


class _Method:
    def __init__(self, group: LearnerGroup, name: str, sync: bool):
        self.group, self.name, self.sync = group, name, sync

    def _submit(self, args, kwargs) -> list:
        self.group._check_inflight()
        return [getattr(r, self.name).remote(*args, **kwargs) for r in self.group.ranks]

    def remote(self, *args: Any, **kwargs: Any):
        import ray

        refs = self._submit(args, kwargs)
        if self.sync:
            return ray.put(wait_all(refs)[0])
        self.group._inflight = refs[1:]
        return refs[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return wait_all(self._submit(args, kwargs))[0]


class LearnerGroup:
    def __init__(
        self,
        model_path: str,
        loss: Any,
        advantage: Any,
        optim: Any,
        world_size: int = 1,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        trajectory_log: str | None = None,
        **learner_kwargs: Any,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncrl.learner.learner import Learner

        self.world_size = world_size
        self._inflight: list = []
        check_fits(world_size, num_cpus, num_gpus)
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.pg = placement_group([bundle] * world_size, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise ConfigError(
                f"learner.world_size={world_size} ranks x {bundle} do not fit: the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free; lower "
                f"learner.world_size / learner.num_cpus / learner.num_gpus"
            ) from None
        rendezvous = self._rendezvous() if world_size > 1 or num_gpus else None
        cls = ray.remote(Learner)
        self.ranks = [
            cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r
                ),
            ).remote(
                model_path,
                loss,
                advantage,
                optim,
                rank=r,
                world_size=world_size,
                rendezvous=rendezvous,
                trajectory_log=trajectory_log if r == 0 else None,
                **learner_kwargs,
            )  # fmt: skip
            for r in range(world_size)
        ]
        for name in ASYNC_METHODS:
            setattr(self, name, _Method(self, name, sync=False))
        for name in SYNC_METHODS:
            setattr(self, name, _Method(self, name, sync=True))
        self.close = _Close(self)

    def _rendezvous(self) -> str:
        """``host:port`` for rank 0's store: loopback when rank 0 shares the driver's node."""
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node0 = placement_group_table(self.pg)["bundles_to_node_id"][0]
        if node0 == ray.get_runtime_context().get_node_id():
            return f"127.0.0.1:{free_port()}"
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)
        task = ray.remote(_remote_rendezvous).options(num_cpus=0, scheduling_strategy=strategy)
        return ray.get(task.remote(), timeout=PLACEMENT_TIMEOUT_S)

    def _check_inflight(self) -> None:
        """Raise the error of a peer rank from an earlier hot-path call, if any."""
        import ray

        if self._inflight:
            done, _ = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
            ray.get(done)
            self._inflight = [r for r in self._inflight if r not in done]

    def named_parameters_stream(self) -> Iterator[tuple[str, Any]]:
        """``(HF name, full CPU tensor)`` from rank 0, produced one FSDP unit at a time with
        at most ``STREAM_BACKPRESSURE`` tensors in flight."""
        import ray

        gens = [
            r.stream_weights.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE
            ).remote()
            for r in self.ranks
        ]
        for ref in gens[0]:
            yield ray.get(ref)
        for g in gens[1:]:
            for ref in g:
                ray.get(ref)


class _Close:
    """Close every rank, then free the actors and the placement group."""

    def __init__(self, group: LearnerGroup):
        self.group = group

    def __call__(self, timeout_s: float = 60.0) -> None:
        import ray

        g = self.group
        try:
            if g.ranks:
                wait_all([r.close.remote() for r in g.ranks], timeout_s)
        finally:
            for r in g.ranks:
                ray.kill(r)
            g.ranks = []
            if g.pg is not None:  # closing twice is harmless
                ray.util.remove_placement_group(g.pg)
                g.pg = None

    def remote(self, timeout_s: float = 60.0):
        import ray

        self(timeout_s)
        return ray.put(None)
