"""The learner: turns batches of trajectory references into optimizer steps.

    driver ── train_step(items, V) ──▶ ray.get(group refs) ─▶ advantages (whole batch)
          ─▶ proximal log-probs (if the loss asks) ─▶ micro-batches by token budget:
             forward, loss(batch, outputs), backward ─▶ clip, AdamW step ─▶ version V+1
    driver ── named_parameters_stream() / state_dict_ref() ──▶ weights for the broker

One rank in this module; ranks of an FSDP group wrap the same step (learner/fsdp.py).
Normalisation is decided here, once per global batch: ``loss_weights`` sum to one
over all tokens (``token``) or give every sequence equal weight (``sequence``), so
micro-batching never changes the loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.learner.batch import TrainBatch, collate, token_budget_chunks
from asyncrl.learner.logprobs import response_logprobs
from asyncrl.losses.base import LossBatch, ModelOutputs

NORMALISATIONS = ("token", "sequence")


@dataclass
class OptimSettings:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0


def loss_weights(
    mb_mask: torch.Tensor, norm: str, total_tokens: int, total_seqs: int
) -> torch.Tensor:
    """Per-token weights of a micro-batch under the global normalisation."""
    m = mb_mask.float()
    if norm == "token":
        return m / max(total_tokens, 1)
    lens = m.sum(1, keepdim=True).clamp(min=1)
    return m / lens / max(total_seqs, 1)


class Learner:
    def __init__(
        self,
        model_path: str,
        loss: Any,
        advantage: Any,
        optim: OptimSettings,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        micro_batch_tokens: int = 4096,
        normalisation: str = "token",
        seed: int = 0,
        num_threads: int = 0,
        trajectory_log: str | None = None,
    ):
        from transformers import AutoModelForCausalLM

        if normalisation not in NORMALISATIONS:
            raise ValueError(
                f"learner.normalisation must be one of {NORMALISATIONS}, got {normalisation!r}"
            )
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.loss = loss
        self.advantage = advantage
        self.optim_cfg = optim
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=tuple(optim.betas),
        )
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.micro_batch_tokens = micro_batch_tokens
        self.normalisation = normalisation
        self.version = 0
        self.pad_id = self.model.config.pad_token_id or 0
        self.traj_log = None
        if trajectory_log:
            from asyncrl.utils.runlog import TrajectoryLog

            self.traj_log = TrajectoryLog(trajectory_log)

    # ---- one step -----------------------------------------------------------------
    def train_step(self, items: list, version: int) -> dict[str, float]:
        """``items``: BatchItems from the queue (refs resolved here, not by the driver)."""
        import ray

        t0 = time.time()
        groups = ray.get([it.ref for it in items])
        keep = [set(it.traj_ids) for it in items]
        trajs = [t for g, k in zip(groups, keep) for t in g.trajectories if t.traj_id in k]
        t_fetch = time.time() - t0
        batch = collate(trajs, self.pad_id)
        metrics = self.step_on_batch(batch, version)
        metrics.update(trajectory_metrics(trajs, version))
        if self.traj_log is not None:
            self.traj_log.write(version, trajs, version)
        metrics["perf/learner_fetch_seconds"] = t_fetch
        metrics["perf/learner_step_seconds"] = time.time() - t0
        return metrics

    def step_on_batch(self, batch: TrainBatch, version: int) -> dict[str, float]:
        if version != self.version:
            raise RuntimeError(
                f"learner holds version {self.version}, driver asked to train version {version}"
            )
        adv_seq = self.advantage(batch.rewards.double(), batch.group_ids).float()
        needs_prox = getattr(self.loss, "needs_proximal", False)
        total_tokens = int(batch.mask.sum())
        chunks = token_budget_chunks(batch.attention_mask.sum(1).tolist(), self.micro_batch_tokens)
        prox = self._proximal(batch, chunks) if needs_prox else {}
        sums: dict[str, float] = {}
        total = 0.0
        for ci, idx in enumerate(chunks):
            mb = batch.rows(idx)
            logp = response_logprobs(self.model, mb, self.temperature, self.top_k, self.top_p)
            lb = LossBatch(
                behaviour_logprobs=mb.behaviour_logprobs,
                versions=mb.versions,
                mask=mb.mask,
                advantages=adv_seq[idx][:, None].expand_as(mb.behaviour_logprobs).contiguous(),
                loss_weights=loss_weights(mb.mask, self.normalisation, total_tokens, len(batch)),
                rewards=mb.rewards,
                group_ids=mb.group_ids,
                learner_version=version,
                proximal_logprobs=prox.get(ci),
            )
            out = self.loss(lb, ModelOutputs(logprobs=logp))
            out.loss.backward()
            total += float(out.loss.detach())
            w = len(idx) / len(batch)  # micro-batch metrics are averaged by row share
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0.0) + w * float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optim_cfg.grad_clip
        )
        self._set_lr()
        before = [p.detach().clone() for p in self.model.parameters()]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        upd = math.sqrt(
            sum(
                float((p.detach() - b).pow(2).sum())
                for p, b in zip(self.model.parameters(), before)
            )
        )
        self.version += 1
        sums.update(
            {
                "loss/total": total,
                "learner/grad_norm": float(grad_norm),
                "learner/update_norm": upd,
                "learner/lr": self.opt.param_groups[0]["lr"],
                "learner/batch_trajectories": len(batch),
                "learner/batch_tokens": int(batch.attention_mask.sum()),
                "learner/micro_batches": len(chunks),
            }
        )
        return sums

    @torch.no_grad()
    def _proximal(self, batch: TrainBatch, chunks: list[list[int]]) -> dict[int, torch.Tensor]:
        return {
            ci: response_logprobs(
                self.model, batch.rows(idx), self.temperature, self.top_k, self.top_p
            )
            for ci, idx in enumerate(chunks)
        }

    def _set_lr(self) -> None:
        w = self.optim_cfg.warmup_steps
        scale = min(1.0, (self.version + 1) / w) if w > 0 else 1.0
        for g in self.opt.param_groups:
            g["lr"] = self.optim_cfg.lr * scale

    # ---- weights out ----------------------------------------------------------------
    def state_dict_ref(self) -> list:
        """The current weights in the object store (one ``ray.put``), wrapped in a list
        so the reference itself travels."""
        import ray

        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # vLLM ties it to the embedding itself
        return [ray.put(sd)]

    @torch.no_grad()
    def logprobs_of(self, trajs: list, version_check: bool = False) -> list:
        """Current log-probs of trajectories' response tokens (for fidelity checks)."""
        import numpy as np

        batch = collate(trajs, self.pad_id)
        lp = response_logprobs(self.model, batch, self.temperature, self.top_k, self.top_p)
        return [np.asarray(lp[b, : int(batch.resp_len[b])]) for b in range(len(trajs))]

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.traj_log is not None:
            self.traj_log.close()
            self.traj_log = None

    def save(self, path: str) -> str:
        self.model.save_pretrained(path, safe_serialization=True)
        torch.save(
            {"optim": self.opt.state_dict(), "version": self.version}, f"{path}/learner_state.pt"
        )
        return path


def trajectory_metrics(trajs: list, learner_version: int) -> dict[str, float]:
    """``reward/*`` and ``staleness/*`` of the trajectories one step trained on."""
    import numpy as np

    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    stale = np.array([learner_version - t.min_version for t in trajs], dtype=np.int64)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/sum": float(rewards.sum()),
        "reward/count": float(len(rewards)),
        "reward/errors": float(sum(bool(t.error) for t in trajs)),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "tokens/trained": float(sum(len(t.response_ids) for t in trajs)),
        "tokens/trained_with_prompt": float(sum(t.num_tokens for t in trajs)),
    }
    keys = {k for t in trajs for k in t.reward_breakdown}
    for k in sorted(keys):
        out[f"reward/{k}"] = float(np.mean([t.reward_breakdown.get(k, 0.0) for t in trajs]))
    return out
