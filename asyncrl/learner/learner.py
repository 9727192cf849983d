"""One learner rank: turns a global batch into an optimizer step.

    train_step(items, V) ─▶ fetch this rank's groups only (learner/shard.py) ─▶ collate
        ─▶ the batch's layout (every rank's row summaries) ─▶ advantages (whole batch,
        from the layout) ─▶ split into ``minibatches`` (1: the whole batch) ─▶ per
        minibatch: loss weights, plan: each rank its rows, packed rows, micro-batches
        ─▶ [proximal log-probs of every minibatch, no grad, before any step]
        ─▶ per minibatch: per micro-batch: forward, loss, backward (gradients accumulate;
           FSDP sums them across ranks on the last one) ─▶ clip, AdamW, LR schedule
        ─▶ version V+1 ─▶ metrics gathered on rank 0
    named_parameters_stream() ─▶ weights for the brokers (learner/weights.py)

Ranks exchange no tokens: each trains on the rows it fetched, and what the step needs of
the others' rows (lengths, trained tokens, rewards, groups) comes with the layout. With
``learner.tp > 1`` the rows are shared among the ``world_size / tp`` data-parallel groups
(``dp_rank``, ``dp_size``): the ``tp`` ranks of one group fetch and train on the same
rows (each holds a slice of every decoder layer), and only the first rank of each group
counts in the metrics.
Ranks with fewer micro-batches run empty ones so that FSDP's collectives line up.
Normalisation is fixed once per global batch: ``loss_weights`` sum to one over all
tokens (``token``) or give every sequence equal weight (``sequence``), so neither
micro-batching nor world size changes the loss. With ``minibatches > 1`` (PPO-style:
several optimizer steps per batch, one policy version) each minibatch is normalised on
its own, and a trust-region loss's clip (decoupled PPO) binds from the second step on,
measured against the batch's start.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncrl.learner.batch import TrainBatch, collate, loss_weights
from asyncrl.learner.checkpoint import Checkpointer
from asyncrl.learner.config import LearnerSettings, OptimSettings
from asyncrl.learner.dist import (
    all_gather,
    all_reduce_sum,
    gather_to_rank0,
    global_norm,
    init_group,
    local,
    pick_device,
    replicas,
    shard,
    stream_local,
    stream_parameters,
    tp_layout,
    value_param,
)  # fmt: skip
from asyncrl.learner.logprobs import to_rows, token_logprobs
from asyncrl.learner.lora import adapter_stream, add_adapters
from asyncrl.learner.metrics import MetricSums, trajectory_metrics
from asyncrl.learner.model import PolicyModel, load_lm, policy_forward
from asyncrl.learner.optim import build_optimizer, clip_grad_norm, kl_brake
from asyncrl.learner.packing import PackedRows, build_packed, plan
from asyncrl.learner.routing import Routing
from asyncrl.learner.shard import (
    Layout,
    Minibatch,
    RowSummary,
    fetch,
    in_queue_order,
    share_items,
    split,
)  # fmt: skip
from asyncrl.learner.tokenlog import TokenRecorder, entropy_metric, is_weights, local_rows
from asyncrl.learner.weights import WeightsOut
from asyncrl.losses.advantages import Advantage
from asyncrl.losses.base import Loss, LossBatch, ModelOutputs
from asyncrl.losses.diagnostics import mismatch_kl_sum
from asyncrl.utils.runlog import TrajectoryLog

__all__ = ["Learner", "OptimSettings", "loss_weights", "trajectory_metrics"]

log = logging.getLogger(__name__)


def held(part: str, method: Callable) -> Callable:
    """``method`` of the learner's ``part`` as the learner's own (what Ray calls on a rank),
    with ``method``'s name, signature and docstring."""

    @functools.wraps(method)
    def call(self: Learner, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), method.__name__)(*args, **kwargs)

    return call


class Learner:
    """One rank (a Ray actor). Holds ``weights`` (:class:`~asyncrl.learner.weights.
    WeightsOut`, whose methods the brokers call on the rank) and ``checkpoints``
    (:class:`~asyncrl.learner.checkpoint.Checkpointer`, behind ``save`` / ``load``)."""

    stream_weights = held("weights", WeightsOut.stream_weights)
    full_state_dict = held("weights", WeightsOut.full_state_dict)
    attach_broker = held("weights", WeightsOut.attach_broker)
    snapshot_weights = held("weights", WeightsOut.snapshot_weights)
    send_weights = held("weights", WeightsOut.send_weights)  # in the weights group
    close_send_groups = held("weights", WeightsOut.close_send_groups)
    detach_broker = held("weights", WeightsOut.detach_broker)
    weight_digests = held("weights", WeightsOut.weight_digests)
    shard_digests = held("weights", WeightsOut.shard_digests)
    weights_ref = held("weights", WeightsOut.weights_ref)

    def __init__(
        self,
        model_path: str,
        loss: Loss,
        advantage: Advantage,
        settings: LearnerSettings,
        *,
        rank: int = 0,
        rendezvous: str | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        trajectory_log: str | None = None,
    ):
        """``settings`` were checked in the driver (``LearnerSettings.from_config``);
        ``temperature`` / ``top_k`` / ``top_p`` are the actors' sampling settings, which
        the log-probs follow; ``rendezvous`` is rank 0's ``host:port`` (LearnerGroup)."""
        s = self.settings = settings
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        self.rank, self.world_size, self.minibatches = rank, s.world_size, s.minibatches
        # the ("dp", "tp") mesh: rows are shared among dp groups, layers split within one
        self.tp, self.dp_size = s.tp, s.world_size // s.tp
        self.dp_rank, self.tp_rank = divmod(rank, s.tp)
        self.device = pick_device()
        # FSDP whenever there is a group to shard over; on one GPU too (bf16 mixed precision)
        self.sharded = s.world_size > 1 or (self.device.type == "cuda" and rendezvous is not None)
        if self.sharded:
            if rendezvous is None:
                raise ValueError("world_size > 1 needs a rendezvous address (LearnerGroup sets it)")
            init_group(rank, s.world_size, rendezvous, s.collective_timeout_s, self.device)
        torch.manual_seed(seed)  # the value head starts identical on every rank
        self.lora = s.lora  # on: only the adapters train and go to the brokers (learner/lora.py)
        self.policy = self._build_policy(model_path)
        self.model = self.policy.lm  # the HF model (HF parameter names)
        self.value_head = self.policy.value_head
        self.routing = Routing(self.model, s.moe.routing_replay)  # MoE routers (none: dense)
        named = [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]
        self.opt, self.sched = build_optimizer(
            (p for n, p in named if not value_param(n)),
            (p for n, p in named if value_param(n)),
            s.optim,
        )
        self.optim_cfg = s.optim
        self.loss, self.advantage = loss, advantage
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.normalisation, self.model_path, self.version = s.normalisation, model_path, 0
        self.lr_scale = 1.0  # the off-policy brake's LR multiplier (optim.kl_brake)
        self.pad_id = self.model.config.pad_token_id or 0
        self.traj_log = None
        self.logging = bool(trajectory_log)  # every rank: rank 0 gathers the rows it logs
        self.tokens = TokenRecorder()  # what the loss used, per token, for the log
        if trajectory_log and rank == 0:
            self.traj_log = TrajectoryLog(trajectory_log)
        self.weights = self._weights_out()
        self.checkpoints = Checkpointer(self.policy, self.opt, self.sched, model_path, s, rank)

    def _weights_out(self) -> WeightsOut:
        """What sends this rank's weights; a sharded rank (LoRA off) can cut engine shards."""
        tp = None
        if self.sharded and not self.lora.on:
            tp = (
                self.tp_rank, self.tp, functools.partial(tp_layout, self.policy),
                functools.partial(stream_local, self.policy),
            )  # fmt: skip
        config = self.model.config.to_dict()
        return WeightsOut(self.rank, self.sharded, self.named_parameters_stream, config, tp)

    def _build_policy(self, model_path: str) -> PolicyModel:
        """The policy (LM, LoRA adapters when on, value head), sharded or on the device."""
        s = self.settings
        lm = load_lm(model_path, s.attn_implementation)
        if s.lora.on:
            lm = add_adapters(lm, s.lora)
        policy = PolicyModel(lm, s.value_head)
        if self.sharded:
            shard(policy, s.world_size, self.device, s.tp, s.ep)
        else:
            policy.to(self.device)
        return policy

    # ---- one step -----------------------------------------------------------------
    def train_step(self, items: list, version: int) -> dict[str, float]:
        """``items``: BatchItems from the queue. Each rank fetches and decodes only the
        groups it trains on (learner/shard.py); rank 0 returns the metrics."""
        t0 = time.time()
        if self.dp_size == 1:
            got = fetch(list(enumerate(items)))
        else:
            owner = share_items(items, self.dp_size)
            got = fetch([(k, it) for k, it in enumerate(items) if owner[k] == self.dp_rank])
        trajs = [t for _, ts in got for t in ts]
        batch = collate(trajs, self.pad_id) if trajs else None
        if self.dp_size == 1:
            layout, summaries = Layout.of_batch(batch), [RowSummary.of(t) for t in trajs]
        else:
            per_rank = self._per_group(all_gather(
                [(k, [RowSummary.of(t) for t in ts]) for k, ts in got]))  # fmt: skip
            layout = Layout.gathered(per_rank)
            by_item = dict(kv for mine in per_rank for kv in mine)
            summaries = [row for k in sorted(by_item) for row in by_item[k]]
        t_fetch = time.time() - t0
        metrics = self._step(batch, layout, version)
        toks = self.tokens.take(len(trajs), [len(t.response_ids) for t in trajs])
        if self.dp_size > 1 and self.logging:  # collective: rank 0 logs every row
            pairs = in_queue_order(self._per_group(gather_to_rank0(list(zip(trajs, toks)))),
                                   layout)  # fmt: skip
            trajs, toks = [t for t, _ in pairs], [k for _, k in pairs]
        if self.rank != 0:
            return {}
        metrics.update(trajectory_metrics(summaries, version))
        if self.traj_log is not None:
            self.traj_log.write(version, trajs, version, toks, metrics)
        metrics["perf/learner_fetch_seconds"] = t_fetch
        metrics["perf/learner_step_seconds"] = time.time() - t0
        return metrics

    def step_on_batch(self, batch: TrainBatch, version: int) -> dict[str, float]:
        """``minibatches`` optimizer steps on the global ``batch`` (every rank gets the same
        one), then version + 1. Returns the metrics on rank 0, ``{}`` elsewhere."""
        return self._step(batch, Layout.of_batch(batch), version)

    def _step(self, batch: TrainBatch | None, layout: Layout, version: int) -> dict[str, float]:
        """``minibatches`` optimizer steps on the batch ``layout`` describes, of which this
        rank holds ``batch``; then version + 1. The metrics on rank 0, ``{}`` elsewhere."""
        if version != self.version:
            raise RuntimeError(
                f"learner holds version {self.version}, driver asked to train version {version}"
            )
        if not sum(layout.mask_tokens):
            return self._skip_empty(layout)
        t0 = time.time()
        # Advantages see the whole batch (whole groups); each minibatch is then one step.
        adv = self.advantage(layout.rewards.double(), layout.group_ids).float()
        s = self.settings
        parts = split(
            batch, layout, adv, self.minibatches, self.dp_rank, self.dp_size,
            s.micro_batch_tokens, s.pack_row_tokens, self.pad_id,
        )  # fmt: skip
        # The proximal policy is the one at the start of the batch, for every minibatch:
        # after the first step, the clip of a trust-region loss measures against it.
        needs_prox = self.loss.needs_proximal
        proxs = [self._proximal(p.packs, p.rows) if needs_prox else {} for p in parts]
        sums, loss_sum, steps, t_opt = MetricSums(), 0.0, [], 0.0
        n_all = max(float(sum(layout.mask_tokens)), 1.0)
        locs = local_rows(layout, self.minibatches, self.dp_rank) if self.logging else None
        for i, (part, prox) in enumerate(zip(parts, proxs, strict=True)):
            kl, losses = self._backward(part, prox, version, sums, n_all, locs and locs[i])
            for x in losses:
                loss_sum += x / len(parts)
            t1 = time.time()
            steps.append(self._optimizer_step(self._brake(kl)))
            t_opt += time.time() - t1
        metrics = {k: sum(st[k] for st in steps) / len(steps) for k in steps[0]}  # step means
        metrics["perf/learner_fwd_bwd_seconds"] = time.time() - t0 - t_opt
        metrics["perf/learner_optim_seconds"] = t_opt
        self.version += 1
        parts_rank0 = self._per_group(gather_to_rank0((sums, loss_sum)))
        if parts_rank0 is None:
            return {}
        metrics.update(MetricSums.merge([s for s, _ in parts_rank0]))
        plans = [p.plan for p in parts]
        metrics.update(
            {
                "loss/total": sum(x for _, x in parts_rank0),
                "learner/batch_trajectories": len(layout),
                "learner/batch_tokens": sum(sum(pl.lengths) for pl in plans),
                "learner/micro_batches": sum(pl.num_micro for pl in plans),
                "learner/optimizer_steps": len(steps),
                "perf/packing_efficiency": sum(pl.efficiency() for pl in plans) / len(plans),
            }
        )
        return metrics

    def _per_group(self, per_rank: list | None) -> list | None:
        """Every rank's item of a gather, one per data-parallel group (its first rank's:
        the ``tp`` ranks of a group hold the same rows); None stays None."""
        return per_rank if per_rank is None else per_rank[:: self.tp]

    def _skip_empty(self, layout: Layout) -> dict[str, float]:
        """A batch without one trained token (every episode ended before the model wrote
        anything: an env that failed at its start, an agent that never called) has no
        gradient: no optimizer step (AdamW would still move the weights), version + 1,
        ``learner/empty_batch`` 1 on rank 0, ``{}`` elsewhere."""
        n = len(layout)
        log.warning("learner: a batch of %d trajectories without a trained token: no step", n)
        self.version += 1
        if self.rank != 0:
            return {}
        return {
            "learner/empty_batch": 1.0,
            "loss/total": 0.0,
            "learner/batch_trajectories": len(layout),
            "learner/batch_tokens": 0,
            "learner/optimizer_steps": 0,
        }

    def _backward(
        self, part: Minibatch, prox: dict, version: int, sums: MetricSums, n_all: float,
        local: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[float]]:  # fmt: skip
        """Forward and backward over this rank's micro-batches of one minibatch (the
        gradients accumulate; FSDP reduces them on the last). Returns this rank's mismatch
        KL sum and token count ``[2]`` and each micro-batch's loss. ``local``: the rows'
        indices in the rank's batch, to record what the loss used per token (the log)."""
        mb = part.rows
        kl = torch.zeros(2, dtype=torch.float64)
        losses: list[float] = []
        if mb is not None:
            weights = loss_weights(mb.mask, self.normalisation, part.tokens, part.seqs)
        for m, pk in enumerate(part.packs):
            self._sync_grads(m == len(part.packs) - 1)
            logits, values = self._forward(pk, mb)
            if not pk.seqs:  # an empty micro-batch: zero gradients, same collectives
                loss = 0.0 * logits.sum() + (0.0 * values.sum() if values is not None else 0.0)
                loss.backward()
                continue
            idx = torch.tensor(pk.seqs)
            lb = self._loss_batch(mb.rows(idx), part.adv[idx], weights[idx], version, prox.get(m))
            logp, vals = self._rows(pk, logits, values, tuple(lb.mask.shape))
            out = self.loss(lb, ModelOutputs(logprobs=logp, values=vals))
            out.loss.backward()
            losses.append(float(out.loss.detach()))
            ent = entropy_metric(logits, pk, lb.mask, self.temperature, self.top_k, self.top_p)
            sums.add({**out.metrics, **ent}, share=float(lb.mask.sum()) / n_all)
            sums.add(*self.routing.take())  # moe/expert_disagreement, weighted by its tokens
            if local is not None:
                isw = is_weights(self.loss, lb, ModelOutputs(logprobs=logp, values=vals))
                self.tokens.add([local[j] for j in pk.seqs], lb, logp, isw)
            if self.optim_cfg.mismatch_kl_target is not None:
                kl += mismatch_kl_sum(logp, lb.behaviour_logprobs, lb.mask)
        return kl, losses

    def _loss_batch(
        self, mb: TrainBatch, adv: torch.Tensor, weights: torch.Tensor, version: int, prox
    ) -> LossBatch:
        """``mb``'s rows as the loss sees them; ``adv`` ``[b]``, ``weights`` ``[b, T_global]``."""
        dev = self.device
        return LossBatch(
            behaviour_logprobs=mb.behaviour_logprobs.to(dev),
            versions=mb.versions.to(dev),
            mask=mb.mask.to(dev),
            advantages=adv[:, None].expand_as(mb.behaviour_logprobs).contiguous().to(dev),
            loss_weights=weights[:, : mb.mask.shape[1]].to(dev),
            rewards=mb.rewards.to(dev),
            group_ids=mb.group_ids.to(dev),
            learner_version=version,
            proximal_logprobs=prox,
        )

    def _brake(self, kl: torch.Tensor) -> float:
        """The off-policy brake's LR multiplier, moved by the minibatch's mismatch KL
        summed over every rank's tokens (so every rank steps alike); 1 when it is off.
        The ``tp`` ranks of a group count their rows ``tp`` times in both sums: the mean
        is the same."""
        target = self.optim_cfg.mismatch_kl_target
        if target is None:
            return 1.0
        total, n = all_reduce_sum(kl.to(self.device)).tolist()
        self.lr_scale = kl_brake(self.lr_scale, total / max(n, 1.0), target)
        return self.lr_scale

    def _optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        params = [p for g in self.opt.param_groups for p in g["params"]]
        grad_norm = clip_grad_norm(params, self.optim_cfg.grad_clip)
        for g in self.opt.param_groups:  # the schedule sets every group's LR anew below
            g["lr"] *= lr_scale
        lr = self.opt.param_groups[0]["lr"]  # the LR this step uses
        with torch.no_grad():  # this rank's shards only: 1/N of the parameters
            before = torch._foreach_mul([local(p) for p in params], 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_sub_(before, [local(p) for p in params])
        upd = global_norm(before, [replicas(p) for p in params])
        return {
            "learner/grad_norm": float(grad_norm),
            "learner/update_norm": float(upd),
            "learner/lr": float(lr),
            "learner/lr_scale": lr_scale,
        }

    def _sync_grads(self, last: bool) -> None:
        """FSDP: reduce-scatter only after the last micro-batch (accumulate locally before)."""
        if self.sharded:
            self.policy.set_requires_gradient_sync(last)

    def _forward(
        self, pk: PackedRows, batch: TrainBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N, V]`` logits and ``[N]`` values (or None) at the response positions;
        ``batch``: the rows ``pk`` packs (their recorded experts, learner/routing.py)."""
        ids, pos, flat = (t.to(self.device) for t in (pk.input_ids, pk.position_ids, pk.flat_pos))
        px = self.policy.pixel_inputs(pk, self.device)  # None: no image in the rows
        # learner.autocast: bf16 matmuls (AMX on a CPU), fp32 weights, fp32 log-probs after
        autocast = torch.autocast(
            self.device.type, torch.bfloat16, enabled=bool(self.settings.autocast)
        )
        with autocast, self.routing.records(batch, pk):
            if self.sharded:  # through the FSDP root, whose hooks unshard the root params
                return self.policy(ids, pos, flat, px)
            return policy_forward(self.model, self.value_head, ids, pos, flat, px)

    def _rows(self, pk: PackedRows, logits, values, shape: tuple[int, int]):
        dev = self.device
        seq, tok = pk.seq.to(dev), pk.tok.to(dev)
        lp = token_logprobs(logits, pk.targets.to(dev), self.temperature, self.top_k, self.top_p)
        vals = to_rows(values, seq, tok, shape) if values is not None else None
        return to_rows(lp, seq, tok, shape), vals

    @torch.no_grad()
    def _proximal(self, packs: list[PackedRows], batch: TrainBatch) -> dict[int, torch.Tensor]:
        """The policy at the start of the step, per micro-batch (``[b, T]``, no grad)."""
        out = {}
        for m, pk in enumerate(packs):
            logits, values = self._forward(pk, batch)
            if pk.seqs:
                T = int(batch.resp_len[torch.tensor(pk.seqs)].max())
                out[m] = self._rows(pk, logits, values, (len(pk.seqs), T))[0]
        return out

    # ---- weights out (learner/weights.py) and checkpoints (learner/checkpoint.py) -----
    def named_parameters_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` one FSDP unit at a time (see ``dist.stream_parameters``:
        valid until the next item; collective, so every rank iterates). With LoRA: the
        adapters only, as asyncrl/engine/adapter.py puts them on the wire."""
        stream = stream_parameters(self.policy, self.sharded)
        return adapter_stream(stream, self.lora.scale) if self.lora.on else stream

    def save(self, path: str, driver_state: dict | None = None, export_hf: bool = True) -> str:
        """Sharded checkpoint (collective); with ``export_hf`` also ``PATH/hf``, an HF model
        directory of the current weights (what vLLM or ``model.path`` can load); with LoRA
        ``PATH/adapter`` instead, a PEFT adapter directory over ``model.path``."""
        hf = self.full_state_dict() if export_hf and not self.lora.on else None  # collective
        return self.checkpoints.save(path, self.version, self.lr_scale, driver_state, hf)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (collective). Returns ``{"version", "driver_state", ...}``."""
        meta = self.checkpoints.load(path)
        self.version, self.lr_scale = int(meta["version"]), float(meta.get("lr_scale", 1.0))
        return meta

    @torch.no_grad()
    def logprobs_of(self, trajs: list, version_check: bool = False) -> list | None:
        """Current log-probs of trajectories' response tokens (for fidelity checks),
        computed on packed rows split across ranks; the list on rank 0."""
        import numpy as np

        batch, s = collate(trajs, self.pad_id), self.settings
        lengths = (batch.resp_start + batch.resp_len).tolist()
        pl = plan(lengths, self.dp_size, s.micro_batch_tokens, s.pack_row_tokens)
        mine = pl.ranks[self.dp_rank]
        found: dict[int, np.ndarray] = {}
        for m in range(pl.num_micro):
            pk = build_packed(batch, mine[m] if m < len(mine) else [], self.pad_id)
            logits, _ = self._forward(pk, batch)
            if not pk.seqs:
                continue
            lp, _ = self._rows(pk, logits, None, (len(pk.seqs), int(batch.resp_len.max())))
            for b, i in enumerate(pk.seqs):
                found[i] = lp[b, : int(batch.resp_len[i])].float().cpu().numpy()
        parts = self._per_group(gather_to_rank0(found))
        if parts is None:
            return None
        merged = {i: a for p in parts for i, a in p.items()}
        return [merged[i] for i in range(len(trajs))]

    def ping(self) -> bool:
        return True

    def pid(self) -> int:  # the rank's process: what a fault test or chaos run kills
        return os.getpid()

    def close(self) -> None:
        import torch.distributed as dist

        self.detach_broker()
        if self.traj_log is not None:
            self.traj_log.close()
            self.traj_log = None
        if self.sharded and dist.is_initialized():
            dist.destroy_process_group()
