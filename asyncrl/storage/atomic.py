"""Directories that appear whole or not at all, sealed by a manifest.

    write ROOT.tmp ─▶ write_manifest (size + CRC32 of every file) ─▶ fsync_tree
      ─▶ switch: ROOT→ROOT.old ─▶ ROOT.tmp→ROOT ─▶ remove ROOT.old
    point_symlink(LINK, target): LINK.link made beside, renamed over LINK

Renames are atomic and nothing complete is removed before its successor is complete and
in place, so a crash at any moment leaves ``ROOT`` or ``ROOT.old`` complete.

The manifest is a CRC, not a signature: it finds torn writes and bit rot, not tampering
(whoever can write a file can write its manifest). Its entries, and every path
:func:`inside` checks, are relative paths that stay inside their root: no absolute path,
no ``..``, no symlink leading out.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CRC_CHUNK = 1 << 22  # bytes read at a time when checksumming
OLD, TMP, LINK = ".old", ".tmp", ".link"  # suffixes of a switch's and a swap's leftovers


class ManifestError(RuntimeError):
    """A directory does not match its manifest, or a path leaves its root; names the file."""


@dataclass(frozen=True)
class Entry:
    """One manifest line: a file's size and CRC32."""

    bytes: int
    crc32: int


def crc32_of(path: Path) -> int:
    c = 0
    with open(path, "rb") as f:
        while chunk := f.read(CRC_CHUNK):
            c = zlib.crc32(chunk, c)
    return c


def inside(root: Path, rel: str) -> Path:
    """``root / rel`` when ``rel`` is relative, has no ``..`` and, symlinks resolved, stays
    under ``root``; else :class:`ManifestError` naming ``rel``."""
    parts = PurePosixPath(rel).parts
    if not rel or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise ManifestError(f"{rel!r} under {root}: only relative paths without '..'")
    path = root / rel
    real, base = path.resolve(), root.resolve()
    if real != base and base not in real.parents:
        raise ManifestError(f"{path} leads out of {root} (to {real})")
    return path


def files_under(root: Path) -> list[Path]:
    """Every file under ``root`` but its manifest, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    entries = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "crc32": crc32_of(p)}
        for p in files_under(root)
    }
    doc = {"format": MANIFEST_FORMAT, "files": entries}
    (root / MANIFEST).write_text(json.dumps(doc, indent=1))


def read_manifest(root: Path) -> dict[str, Entry]:
    """The manifest's entries, every path checked by :func:`inside`."""
    man = root / MANIFEST
    if not man.is_file():
        raise ManifestError(
            f"{man} is missing: {root} is not complete (an interrupted write, or not a "
            f"directory this program wrote)"
        )
    try:
        files = json.loads(man.read_text())["files"]
        entries = {rel: Entry(int(e["bytes"]), int(e["crc32"])) for rel, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"{man} is corrupted: {type(e).__name__}: {e}") from e
    for rel in entries:
        inside(root, rel)
    return entries


def check_manifest(root: Path, full: bool = True) -> dict[str, Entry]:
    """Every file against the manifest (sizes; CRCs too when ``full``); the entries.
    Raises :class:`ManifestError` naming the first bad file."""
    entries = read_manifest(root)
    for rel, want in entries.items():
        f = root / rel
        if not f.is_file():
            raise ManifestError(f"file {f} is missing")
        size = f.stat().st_size
        if size != want.bytes:
            raise ManifestError(
                f"file {f} is corrupted: {size} bytes, the manifest says {want.bytes}"
            )
        if full and crc32_of(f) != want.crc32:
            raise ManifestError(f"file {f} is corrupted: CRC32 mismatch")
    return entries


def fsync_tree(root: Path) -> None:
    """Contents on disk before the rename makes them current (a power cut after the
    rename must not leave a renamed directory of empty files)."""
    for p in [*files_under(root), root / MANIFEST]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def switch(tmp: Path, root: Path) -> None:
    """``tmp`` (complete) becomes ``root``; the old ``root`` is removed only after."""
    old = root.with_name(root.name + OLD)
    if old.exists() and not root.exists():  # a crash inside the last switch: restore first
        os.replace(old, root)
    shutil.rmtree(old, ignore_errors=True)  # root is complete, so this leftover is spare
    if root.exists():
        os.replace(root, old)
    os.replace(tmp, root)
    shutil.rmtree(old, ignore_errors=True)


def seal(tmp: Path, root: Path) -> None:
    """Manifest, fsync, switch: ``tmp``, written whole, becomes ``root``."""
    write_manifest(tmp)
    fsync_tree(tmp)
    switch(tmp, root)


def point_symlink(link: Path, target: Path) -> None:
    """``link`` points at ``target`` (relative targets stay relative), swapped atomically:
    a reader sees the old target or the new one."""
    aside = link.with_name(link.name + LINK)
    aside.unlink(missing_ok=True)
    aside.symlink_to(target, target_is_directory=True)
    os.replace(aside, link)
