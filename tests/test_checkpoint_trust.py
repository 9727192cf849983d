"""Loading a checkpoint runs no code from its directory.

A pickle whose unpickling writes a marker file is planted in each file of a saved
checkpoint in turn (the DCP metadata, the shard, the RNG file, the JSON files, the HF
export), inside a valid metadata object, and as one item of the shard (a tensor item and
a non-tensor item, the metadata pointing at it). The manifest is re-sealed after each
plant: it is a CRC, and whoever can write the directory can rewrite it. Every load either
fails with a CheckpointError naming the file (or the DCP directory) or, for the HF export
that a resume never reads, succeeds; the marker never appears.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from asyncrl.learner import layout
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.safe_dcp import METADATA, read_metadata
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.storage import atomic


class Plant:
    """Unpickled, it runs ``exec``, which writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A learner and its checkpoint after one step."""
    torch.set_num_threads(1)
    model = build_tiny_qwen(tmp_path_factory.mktemp("m"))
    L = Learner(
        str(model),
        ClippedISLoss(),
        GroupNormalized(),
        LearnerSettings.defaults(optim=plain_optim(lr=1e-2), micro_batch_tokens=40),
        seed=1,
    )
    L.step_on_batch(collate(trajs(8, seed=3)), 0)
    path = tmp_path_factory.mktemp("ck") / "ck"
    L.save(str(path), driver_state={"queue": {}})
    return L, path


def test_the_payload_runs_when_unpickled_plainly(tmp_path):
    """The control: what the loads below refuse would have run."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Plant(marker)))
    assert marker.read_text() == "ran"


def copy(saved_path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ck"
    shutil.copytree(saved_path, out, symlinks=True)
    return out


def load_after_plant(L: Learner, root: Path, marker: Path) -> str | None:
    """Re-seal, load; the CheckpointError's message, or None when it loaded."""
    atomic.write_manifest(root)
    try:
        L.load(str(root))
        error = None
    except layout.CheckpointError as e:
        error = str(e)
    assert not marker.exists(), "the planted payload ran"
    return error


FILES = [
    "state/.metadata",
    "state/__0_0.distcp",
    "rng/rank0.safetensors",
    "learner.json",
    "driver_state.json",
    "manifest.json",
    "hf/model.safetensors",
    "hf/config.json",
]


def test_every_file_a_resume_reads_is_planted_below(saved):
    _, path = saved
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert {f for f in files if not f.startswith("hf/")} == {
        f for f in FILES if not f.startswith("hf/")
    }


@pytest.mark.parametrize("rel", FILES)
def test_a_pickle_planted_in_a_file_never_runs(saved, tmp_path, rel):
    L, path = saved
    root, marker = copy(path, tmp_path), tmp_path / "marker"
    assert (root / rel).is_file(), sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    (root / rel).write_bytes(pickle.dumps(Plant(marker)))
    if rel == atomic.MANIFEST:  # the manifest itself planted, not re-sealed
        with pytest.raises(layout.CheckpointError, match=re.escape(str(root / rel))):
            L.load(str(root))
        assert not marker.exists()
        return
    error = load_after_plant(L, root, marker)
    if rel.startswith("hf/"):  # the HF export: a resume never reads it
        assert error is None
    elif rel.startswith("state/"):
        assert error and str(root / layout.STATE_DIR) in error, error
        if rel.endswith(METADATA):
            assert "builtins.exec" in error and "refused" in error, error
    else:
        assert error and str(root / rel) in error, error


def test_a_plant_inside_valid_metadata_is_refused(saved, tmp_path):
    L, path = saved
    root, marker = copy(path, tmp_path), tmp_path / "marker"
    state = root / layout.STATE_DIR
    md = read_metadata(state)
    md.planner_data = {"x": Plant(marker)}
    (state / METADATA).write_bytes(pickle.dumps(md))
    error = load_after_plant(L, root, marker)
    assert error and re.search(r"\.metadata asks for builtins\.exec.*refused", error), error


@pytest.mark.parametrize("kind", [TensorStorageMetadata, BytesStorageMetadata])
def test_a_plant_as_one_item_of_the_shard_is_refused(saved, tmp_path, kind):
    """The metadata points one item (a tensor, or a non-tensor such as an optimizer
    hyper-parameter) at a pickle appended to the shard."""
    L, path = saved
    root, marker = copy(path, tmp_path), tmp_path / "marker"
    state = root / layout.STATE_DIR
    md = read_metadata(state)
    index, info = next(
        (i, s)
        for i, s in md.storage_data.items()
        if isinstance(md.state_dict_metadata[i.fqn], kind)
    )
    blob = io.BytesIO()
    torch.save(Plant(marker), blob)
    shard = state / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    (state / METADATA).write_bytes(pickle.dumps(md))
    error = load_after_plant(L, root, marker)
    assert error and str(state) in error, error
    assert "refused by torch.load(weights_only=True)" in error and "exec" in error, error


def test_metadata_naming_a_file_outside_is_refused(saved, tmp_path):
    L, path = saved
    root, marker = copy(path, tmp_path), tmp_path / "marker"
    state = root / layout.STATE_DIR
    md = read_metadata(state)
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = dataclasses.replace(info, relative_path="../../../../etc/passwd")
    (state / METADATA).write_bytes(pickle.dumps(md))
    error = load_after_plant(L, root, marker)
    assert error and "names a storage file outside" in error, error
