"""A save killed at any moment leaves a complete checkpoint that resumes.

Two ways to kill it: a failure injected at every point between the save's steps (the
real functions at each boundary wrapped to raise: the RNG file written, the manifest
about to be written, the tree fsynced, each rename of the switch and of the symlink swap
through a proxy of the storage module's ``os``, a pruned step removed), and SIGKILL of a
real process looping over saves at moments spread across a save. After each, ``find_latest(run_dir)`` must name a
checkpoint that passes the full CRC check and loads, at the previous or the new version.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.learner import checkpoint as ck
from asyncrl.learner import layout
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.storage import atomic

POINTS = [
    "shards written", "files written", "manifest written", "old moved aside",
    "new in place", "latest switched", "pruned one",
]  # fmt: skip
KEEP = 2


class Crash(Exception):
    pass


def raise_after(fn: Callable, point: str) -> Callable:
    def wrapped(*args, **kwargs):
        fn(*args, **kwargs)
        raise Crash(point)

    return wrapped


def raise_before(point: str) -> Callable:
    def wrapped(*args, **kwargs):
        raise Crash(point)

    return wrapped


class RenameThenCrash:
    """The storage module's ``os``: ``replace`` renames, then raises when ``hit(src, dst)``."""

    def __init__(self, point: str, hit: Callable[[Path, Path], bool]):
        self.point, self.hit = point, hit

    def __getattr__(self, name: str):
        return getattr(os, name)

    def replace(self, src, dst) -> None:
        os.replace(src, dst)
        if self.hit(Path(src), Path(dst)):
            raise Crash(self.point)


def prune_then_crash(point: str) -> Callable:
    rmtree = shutil.rmtree

    def wrapped(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        if re.fullmatch(r"step-\d+", Path(path).name):  # a pruned step, not a leftover
            raise Crash(point)

    return wrapped


def inject(monkeypatch, point: str) -> None:
    """Make the save raise :class:`Crash` at ``point``."""
    renames = {
        "old moved aside": lambda src, dst: dst.name.endswith(atomic.OLD),
        "new in place": lambda src, dst: src.name.endswith(atomic.TMP),
        "latest switched": lambda src, dst: src.name.endswith(atomic.LINK),
    }
    if point == "shards written":  # every shard and rank 0's RNG file
        monkeypatch.setattr(ck, "save_rng", raise_after(ck.save_rng, point))
    elif point == "files written":  # learner.json, driver state, hf/; no manifest yet
        monkeypatch.setattr(atomic, "write_manifest", raise_before(point))
    elif point == "manifest written":
        monkeypatch.setattr(atomic, "fsync_tree", raise_after(atomic.fsync_tree, point))
    elif point in renames:
        monkeypatch.setattr(atomic, "os", RenameThenCrash(point, renames[point]))
    else:
        assert point == "pruned one"
        monkeypatch.setattr(shutil, "rmtree", prune_then_crash(point))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def make(model_dir) -> Learner:
    torch.set_num_threads(1)
    return Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=plain_optim(lr=1e-2), micro_batch_tokens=40), seed=1,
    )  # fmt: skip


def save_step(L: Learner, run: Path, version: int, keep: int = KEEP) -> None:
    """What the driver's save_checkpoint does, without Ray."""
    L.version = version
    L.save(str(layout.step_dir(run, version)), driver_state={"v": version})
    layout.publish(run, version, keep)


def assert_resumable(model_dir, run: Path, versions: set[int]) -> int:
    found = layout.find_latest(run)
    meta = layout.verify(found, full=True)  # every byte against the manifest
    assert meta["version"] in versions, (found, meta["version"])
    loaded = make(model_dir).load(str(found))
    assert loaded["driver_state"] == {"v": meta["version"]}
    return meta["version"]


# A save of a new step prunes the oldest; the final save repeats the last periodic step.
CASES = [("next_step", p) for p in POINTS if p != "old moved aside"] + [
    ("same_step_again", p) for p in POINTS if p != "pruned one"]  # fmt: skip


@pytest.mark.parametrize("scenario,point", CASES)
def test_a_save_killed_at_each_point_leaves_a_complete_checkpoint(
    model_dir, tmp_path, monkeypatch, scenario, point
):
    L = make(model_dir)
    L.step_on_batch(collate(trajs(8, seed=3)), 0)
    run = tmp_path / "run"
    save_step(L, run, 1)
    save_step(L, run, 2)
    new = 3 if scenario == "next_step" else 2  # the final save repeats the last step
    inject(monkeypatch, point)
    with pytest.raises(Crash, match=point):  # the save did stop there
        save_step(L, run, new)
    monkeypatch.undo()
    got = assert_resumable(model_dir, run, {2, new})
    if POINTS.index(point) >= POINTS.index("new in place"):
        assert got == new  # once the new one is in place it is the one found
    save_step(L, run, new)  # the next save after the crash succeeds and cleans up
    assert assert_resumable(model_dir, run, {new}) == new
    steps = sorted(p.name for p in (run / layout.STEPS_DIR).iterdir())
    assert steps == sorted({f"step-{v}" for v in (1, 2, new)})[-KEEP:]
    assert os.readlink(run / layout.LATEST) == f"{layout.STEPS_DIR}/step-{new}"


def test_resume_takes_a_run_dir_or_a_checkpoint_dir(model_dir, tmp_path):
    L = make(model_dir)
    run = tmp_path / "run"
    for v in (1, 2, 3):
        save_step(L, run, v, keep=0)
    assert sorted(p.name for p in (run / layout.STEPS_DIR).iterdir()) == [
        "step-1", "step-2", "step-3"]  # fmt: skip
    (run / layout.STEPS_DIR / "step-3" / layout.MANIFEST).unlink()  # step-3 incomplete
    assert layout.find_latest(run) == run / layout.STEPS_DIR / "step-2"
    assert (
        layout.find_latest(run / layout.STEPS_DIR / "step-1") == run / layout.STEPS_DIR / "step-1"
    )
    (run / layout.STEPS_DIR / "step-2" / layout.META).unlink()
    (run / layout.STEPS_DIR / "step-1" / layout.MANIFEST).unlink()
    with pytest.raises(layout.CheckpointError, match="no complete checkpoint"):
        layout.find_latest(run)


SAVER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_checkpoint_atomic import make, save_step
from pathlib import Path
L = make(Path({model!r}))
run = Path({run!r})
v = {start}
while True:
    save_step(L, run, v)
    print(f"saved {{v}}", flush=True)
    v += 1
"""


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_complete_checkpoint(model_dir, tmp_path):
    """Real kills: a process saving in a loop is SIGKILLed at moments spread over a
    save; the run directory resumes, from the newest or the one before."""
    run = tmp_path / "run"
    L = make(model_dir)
    save_step(L, run, 1)
    t = time.time()
    save_step(L, run, 2)
    one_save = time.time() - t
    start = 3
    for frac in (0.5,):  # one kill: each costs a process start (~20 s under load)
        code = SAVER.format(tests=str(Path(__file__).parent), model=str(model_dir),
                            run=str(run), start=start)  # fmt: skip
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            line = p.stdout.readline()  # the first save done: the next is under way
            assert line.startswith("saved"), line
            time.sleep(frac * one_save)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        # On a loaded machine the sleep can outlast more than one save: the newest save
        # the process reported finished before the kill.
        last = max(int(x.split()[1]) for x in [line, *p.stdout.read().splitlines()])
        got = assert_resumable(model_dir, run, {last, last + 1})
        start = got + 1
