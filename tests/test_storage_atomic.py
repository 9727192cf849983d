"""asyncrl.storage.atomic: a sealed directory checks out, a damaged one names its file, and
a manifest only ever names relative paths inside its root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.storage import atomic


def sealed(tmp_path: Path) -> Path:
    tmp, root = tmp_path / "d.tmp", tmp_path / "d"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.txt").write_text("alpha")
    (tmp / "sub" / "b.bin").write_bytes(b"\x00\x01\x02")
    atomic.seal(tmp, root)
    return root


def test_seal_switches_a_complete_tree_in(tmp_path):
    root = sealed(tmp_path)
    assert not (tmp_path / "d.tmp").exists() and not (tmp_path / "d.old").exists()
    got = atomic.check_manifest(root)
    assert set(got) == {"a.txt", "sub/b.bin"} and got["a.txt"].bytes == 5
    (root / "sub" / "b.bin").write_bytes(b"\x00\x01\x03")
    with pytest.raises(atomic.ManifestError, match=r"b\.bin is corrupted: CRC32"):
        atomic.check_manifest(root)
    atomic.check_manifest(root, full=False)  # same size: only the CRC sees it


def forge(root: Path, rel: str) -> None:
    """The manifest rewritten to name ``rel`` (what anyone who can write it can do)."""
    man = json.loads((root / atomic.MANIFEST).read_text())
    man["files"][rel] = {"bytes": 3, "crc32": 0}
    (root / atomic.MANIFEST).write_text(json.dumps(man))


@pytest.mark.parametrize(
    "rel,why",
    [
        ("/etc/hostname", "only relative paths"),
        ("../outside.txt", "only relative paths"),
        ("sub/../../outside.txt", "only relative paths"),
        ("link/secret", "leads out of"),
    ],
)
def test_a_manifest_names_only_paths_inside_its_root(tmp_path, rel, why):
    root = sealed(tmp_path)
    (tmp_path / "outside.txt").write_text("abc")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret").write_text("abc")
    (root / "link").symlink_to(tmp_path / "elsewhere")
    forge(root, rel)
    with pytest.raises(atomic.ManifestError, match=why):
        atomic.check_manifest(root)


def test_point_symlink_swaps_atomically(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    link = tmp_path / "latest"
    atomic.point_symlink(link, Path("one"))
    atomic.point_symlink(link, Path("two"))
    assert str(link.readlink()) == "two" and not (tmp_path / "latest.link").exists()
