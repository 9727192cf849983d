"""The trajectory log: closed part files every ``log.part_every`` steps, read back as one
table; sampling and the row cap; the per-token record of what the loss used; a writer
killed mid-run leaves every finished part readable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.config import ConfigError
from asyncrl.utils.runlog import (
    LogSettings,
    TrajectoryLog,
    read_batches,
    read_trajectories,
    trajectory_parts,
)  # fmt: skip


def _spec(tmp_path, **kw):
    return LogSettings.defaults(**kw).spec(tmp_path)


def test_parts_every_n_steps_read_as_one_table(tmp_path):
    log = TrajectoryLog(_spec(tmp_path, part_every=2))
    ts = trajs(20)
    for step in range(5):  # 4 trajectories a step
        log.write(step + 1, ts[4 * step : 4 * step + 4], step + 1)
    # steps 1-2 and 3-4 are closed parts; step 5 is buffered until close
    assert [p.name for p in trajectory_parts(tmp_path)] == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert (
        pq.read_table(trajectory_parts(tmp_path)[1]).column("step").to_pylist() == [3] * 4 + [4] * 4
    )
    log.close()
    t = read_trajectories(tmp_path)
    assert t.column("traj_id").to_pylist() == [x.traj_id for x in ts]
    assert t.column("step").to_pylist() == [s for s in range(1, 6) for _ in range(4)]
    assert t.column("learner_logprobs").to_pylist() == [None] * 20  # none recorded
    batches = read_batches(tmp_path)
    assert batches == {s + 1: [x.traj_id for x in ts[4 * s : 4 * s + 4]] for s in range(5)}
    assert not list((tmp_path / "trajectories").glob("*.tmp"))


def test_per_token_columns_round_trip(tmp_path):
    log = TrajectoryLog(_spec(tmp_path, part_every=1))
    ts = trajs(3)
    toks = [
        {k: np.arange(len(t.response_ids), dtype=np.float32) * s
         for k, s in (("learner_logprobs", -0.5), ("advantages", 2.0), ("is_weights", 1.5))}
        for t in ts
    ]  # fmt: skip
    toks[1] = None  # a row the learner recorded nothing for
    log.write(1, ts, 1, toks)
    t = read_trajectories(tmp_path).to_pylist()
    for row, tr, tok in zip(t, ts, toks, strict=True):
        assert row["response_tokens"] == len(tr.response_ids)
        if tok is None:
            assert row["is_weights"] is None
            continue
        for k in ("learner_logprobs", "advantages", "is_weights"):
            assert row[k] == pytest.approx(tok[k].tolist())


def test_routed_experts_round_trip_to_replay(tmp_path):
    """A MoE run's routed experts: logged as bytes and shape, rebuilt by asyncrl-replay
    into the array the learner replayed; a row without any stays without."""
    from asyncrl.tools.replay import REPLAY_COLUMNS, trajectories_of

    log = TrajectoryLog(_spec(tmp_path, part_every=1))
    ts = trajs(2)
    n = ts[0].num_tokens - 1
    ts[0].routed_experts = np.arange(n * 2 * 2, dtype=np.uint8).reshape(n, 2, 2) % 8
    log.write(1, ts, 1)
    log.close()
    cols = [*REPLAY_COLUMNS, "routed_experts", "routed_experts_shape"]
    rows = read_trajectories(tmp_path, columns=cols).to_pylist()
    back = trajectories_of({1: {r["traj_id"]: r for r in rows}}, [t.traj_id for t in ts], 1)
    assert back[0].routed_experts.tolist() == ts[0].routed_experts.tolist()
    assert back[0].routed_experts.dtype == np.uint8 and back[1].routed_experts is None


def test_sampling_and_row_cap(tmp_path):
    ts = trajs(200)
    a = TrajectoryLog(_spec(tmp_path / "a", sample_frac=0.25))
    a.write(1, ts, 1)
    a.close()
    got = read_trajectories(tmp_path / "a").column("traj_id").to_pylist()
    assert 20 < len(got) < 80, len(got)  # about a quarter, by a hash of the id
    b = TrajectoryLog(_spec(tmp_path / "b", sample_frac=0.25))
    b.write(1, ts, 1)
    b.close()
    assert read_trajectories(tmp_path / "b").column("traj_id").to_pylist() == got  # deterministic
    c = TrajectoryLog(_spec(tmp_path / "c", max_rows=30, part_every=1))
    for s in range(3):
        c.write(s + 1, ts[s * 20 : s * 20 + 20], s + 1)
    c.close()
    assert read_trajectories(tmp_path / "c").num_rows == 30 and c.rows_skipped == 30
    assert len(read_batches(tmp_path / "c")) == 3  # the batch ids are never capped


def test_legacy_single_file_still_reads(tmp_path):
    import pyarrow as pa

    pq.write_table(
        pa.table({"traj_id": ["a", "b"], "step": [1, 1]}), tmp_path / "trajectories.parquet"
    )
    assert read_trajectories(tmp_path).column("traj_id").to_pylist() == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="no trajectory log"):
        read_trajectories(tmp_path / "nothing")


@pytest.mark.parametrize(
    "node,match",
    [
        ({"part_every": 0}, "log.part_every=0"),
        ({"sample_frac": 1.5}, "log.sample_frac=1.5"),
        ({"max_rows": -1}, "log.max_rows=-1"),
        ({"part_evry": 3}, r"log: unknown key\(s\) \['part_evry'\]"),
        ({"part_every": "x"}, "log.part_every='x'"),
    ],
)
def test_bad_settings_name_the_key(node, match):
    with pytest.raises(ConfigError, match=match):
        LogSettings.defaults(**node)


def test_writer_killed_mid_run_leaves_finished_parts(tmp_path):
    """A process writing parts every step is SIGKILLed after three: all three read."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from helpers import trajs
        from asyncrl.utils.runlog import LogSettings, TrajectoryLog
        log = TrajectoryLog(LogSettings.defaults(part_every=1).spec(__import__('pathlib').Path({str(tmp_path)!r})))
        ts = trajs(16)
        for s in range(3):
            log.write(s + 1, ts[4 * s: 4 * s + 4], s + 1)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    parts = trajectory_parts(tmp_path)
    assert len(parts) == 3
    for k, p in enumerate(parts):
        assert pq.read_table(p).column("step").to_pylist() == [k + 1] * 4
    assert read_trajectories(tmp_path).num_rows == 12


@pytest.mark.slow
def test_learner_logs_what_the_loss_used(ray_local, tmp_path):
    """One real train_step with the log on: per token, the learner's log-probs are the
    model's at the step's start, the IS weights exp(learner - behaviour) (clipped loss),
    the advantages the group-normalised rewards; rows in queue order."""
    from test_fsdp_learner import queue_items

    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.learner import Learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen(tmp_path / "m")
    ts = trajs(12, seed=3, max_prompt=8, max_response=10)
    learner = Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=plain_optim(lr=1e-3), num_threads=1, micro_batch_tokens=40),
        trajectory_log=LogSettings.defaults(part_every=1).spec(tmp_path),
    )  # fmt: skip
    before = learner.logprobs_of(ts)  # version 0: what the step's forward sees
    m = learner.train_step(queue_items(ts), 0)
    learner.close()
    assert m["actor/entropy"] > 0
    rows = read_trajectories(tmp_path).to_pylist()
    assert [r["traj_id"] for r in rows] == [t.traj_id for t in ts]
    rewards = torch.tensor([t.reward for t in ts], dtype=torch.float64)
    gids = torch.tensor([int(t.group_id[1:]) for t in ts])
    adv = GroupNormalized()(rewards, gids).float()
    for row, t, lp, a in zip(rows, ts, before, adv, strict=True):
        got = np.array(row["learner_logprobs"])
        assert got.shape == (len(t.response_ids),)
        np.testing.assert_allclose(got, lp, atol=1e-5)
        np.testing.assert_allclose(row["is_weights"], np.exp(got - t.behaviour_logprobs), rtol=1e-5)
        np.testing.assert_allclose(row["advantages"], [float(a)] * len(got), rtol=1e-6)


def test_images_are_written_once_beside_the_parts_and_named_by_a_column(tmp_path):
    from asyncrl.trajectory import Image

    log = TrajectoryLog(_spec(tmp_path, part_every=1))
    ts = trajs(4)
    a, b = Image.of(b"\x89PNG a"), Image.of(b"\x89PNG b")
    for t in ts[:3]:
        t.images = [a]  # one group's samples share their prompt's image
    ts[3].images = [a, b]
    log.write(1, ts, 1)
    log.close()
    table = read_trajectories(tmp_path)
    names = table.column("images").to_pylist()
    assert names[:3] == [[f"images/{a.key}.png"]] * 3 and names[3][1] == f"images/{b.key}.png"
    files = sorted((tmp_path / "trajectories" / "images").iterdir())
    assert [f.read_bytes() for f in files] == sorted([a.png, b.png], key=lambda x: Image.of(x).key)
    text = TrajectoryLog(_spec(tmp_path / "text"))
    text.write(1, trajs(2), 1)
    text.close()
    assert read_trajectories(tmp_path / "text").column("images").to_pylist() == [[], []]
