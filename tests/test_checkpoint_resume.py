"""Checkpoint and exact resume of the learner (one rank, in-process, CPU).

A run checkpointed at step k and resumed reaches, at step k+m, bit-identical
parameters, optimizer state and LR to the uninterrupted run fed the same batches.
A damaged checkpoint fails naming the damaged file.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.layout import CheckpointError, verify
from asyncrl.learner.learner import Learner
from asyncrl.learner.optim import lr_factor
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss
from asyncrl.losses.vtrace import VTraceLoss

K, M = 2, 2  # checkpoint after K steps, then M more
SETUPS = {
    # plain IS loss, constant LR
    "clipped": (ClippedISLoss, False, plain_optim(lr=1e-2)),
    # value head with its own LR, warm-up + cosine
    "vtrace_value_head": (
        lambda: VTraceLoss(use_value_head=True),
        True,
        plain_optim(
            lr=1e-2,
            warmup_steps=2,
            schedule="cosine",
            total_steps=5,
            min_lr_ratio=0.1,
            value_lr=3e-2,
        ),
    ),
    # proximal log-probs (a second forward per step)
    "decoupled_ppo": (DecoupledPPOLoss, False, plain_optim(lr=1e-2, weight_decay=0.1)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def make(model_dir, setup: str) -> Learner:
    torch.set_num_threads(1)
    loss, value_head, optim = SETUPS[setup]
    return Learner(
        str(model_dir), loss(), GroupNormalized(),
        LearnerSettings.defaults(optim=optim, micro_batch_tokens=40, value_head=value_head), seed=1,
    )  # fmt: skip


def batches(n: int):
    return [collate(trajs(12, seed=100 + i)) for i in range(n)]


def snapshot(L: Learner) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in L.policy.named_parameters()}
    for i, st in enumerate(L.opt.state.values()):
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    out["lr"] = torch.tensor([g["lr"] for g in L.opt.param_groups], dtype=torch.float64)
    return out


@pytest.mark.parametrize("setup", list(SETUPS))
def test_resume_is_bit_exact(model_dir, tmp_path, setup):
    bs = batches(K + M)
    a = make(model_dir, setup)
    for v in range(K):
        a.step_on_batch(bs[v], v)
    a.save(str(tmp_path / "ck"), driver_state={"queue": {"note": "opaque"}})
    tail_a = [a.step_on_batch(bs[v], v) for v in range(K, K + M)]

    b = make(model_dir, setup)
    meta = b.load(str(tmp_path / "ck"))
    assert meta["version"] == K and b.version == K
    assert meta["driver_state"] == {"queue": {"note": "opaque"}}
    tail_b = [b.step_on_batch(bs[v], v) for v in range(K, K + M)]

    sa, sb = snapshot(a), snapshot(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for ma, mb in zip(tail_a, tail_b):
        assert ma["loss/total"] == mb["loss/total"]
        assert ma["learner/grad_norm"] == mb["learner/grad_norm"]


def test_resume_with_a_longer_run_follows_the_longer_cosine(model_dir, tmp_path):
    """A run resumed with a larger max_steps (a longer cosine horizon) takes its first
    step at the longer cosine's LR, not at the finished schedule's last LR (0)."""
    short = plain_optim(lr=1e-2, schedule="cosine", total_steps=K)
    a = Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=short, micro_batch_tokens=40),
    )  # fmt: skip
    for v, b in enumerate(batches(K)):
        a.step_on_batch(b, v)
    assert a.opt.param_groups[0]["lr"] == 0.0  # the short schedule has ended
    a.save(str(tmp_path / "ck"))
    longer = plain_optim(lr=1e-2, schedule="cosine", total_steps=4 * K)
    b = Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=longer, micro_batch_tokens=40),
    )  # fmt: skip
    b.load(str(tmp_path / "ck"))
    m = b.step_on_batch(batches(K + 1)[K], K)
    assert m["learner/lr"] == pytest.approx(1e-2 * lr_factor(K, longer)) and m["learner/lr"] > 0


def test_checkpoint_layout_and_hf_export(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    L = make(model_dir, "clipped")
    L.step_on_batch(batches(1)[0], 0)
    path = tmp_path / "ck"
    L.save(str(path))
    meta = verify(path)
    assert meta["version"] == 1 and meta["world_size"] == 1
    assert json.loads((path / "manifest.json").read_text())["files"]
    hf = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32)
    for n, p in hf.named_parameters():
        assert torch.equal(p, L.model.get_parameter(n)), n
    L.save(str(path))  # saving again replaces the checkpoint whole
    assert not (tmp_path / "ck.tmp").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_checkpoint_names_the_file(model_dir, tmp_path, damage):
    L = make(model_dir, "clipped")
    L.step_on_batch(batches(1)[0], 0)
    path = tmp_path / "ck"
    L.save(str(path))
    shard = next((path / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-7]))
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=str(shard)):
        make(model_dir, "clipped").load(str(path))


def test_incomplete_checkpoint_is_refused(model_dir, tmp_path):
    L = make(model_dir, "clipped")
    path = tmp_path / "ck"
    L.save(str(path))
    (path / "manifest.json").unlink()  # what an interrupted save looks like
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        make(model_dir, "clipped").load(str(path))
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        make(model_dir, "clipped").load(str(tmp_path / "nowhere"))
