"""FileSink: a Ray actor on the driver's node that writes other nodes' files into the
driver's run directory, so a run's outputs end up where the driver reads them whether
or not the nodes share a filesystem.

    init_ray (joined cluster) ──start_sink()──▶ FileSink, pinned to the driver's node
    LogSettings.spec(RUN) ──allow_run_dir(RUN)──▶ the sink writes under RUN only
    learner rank on another node (remote.py):
        parquet part / checkpoint file, written to a local staging dir first
          ──put(path, offset, chunk, last)──▶ PATH.sink, os.replace(PATH.sink, PATH) at last
        batches.jsonl line ──append──▶       checkpoint tmp complete ──seal──▶ manifest,
                                              fsync, switch (atomic.seal, as a local save)
        resume: verify(PATH) at the driver's side, then get(PATH, rel, offset, n) into staging

A plain actor: one call at a time, and one caller's calls in the order made (a file's
chunks arrive in order). Every path it writes or reads lies inside an allowed run
directory: absolute on the driver's node with no ``..``, and still inside once symlinks
are resolved; files of a tree are named relative to it (``atomic.inside``). That keeps a
wrong path from writing or serving anything else of the driver's node; it is not a
boundary against job code, which may run anything on any node of its cluster. Every
finished file is recorded in ``RUN/cluster_sink.jsonl`` (what came from which node, how
many bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from asyncrl.storage.atomic import ManifestError, check_manifest, inside, seal

if TYPE_CHECKING:
    from ray.actor import ActorHandle

SINK_NAME = "asyncrl-file-sink"
RECORD = "cluster_sink.jsonl"
PARTIAL = ".sink"  # suffix of a file still arriving

_driver_sink: ActorHandle | None = None  # the driver's handle, when it started one (init_ray)


class FileSink:
    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.roots: list[Path] = []  # run directories: written and read
        self.read_roots: list[Path] = []  # read only (a checkpoint resumed from elsewhere)
        self.files = 0
        self.bytes = 0

    def node(self) -> str:
        return self.node_id

    def allow(self, run_dir: str) -> None:
        root = Path(run_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        if root not in self.roots:
            self.roots.append(root)

    def allow_reads(self, folder: str) -> None:
        root = Path(folder).resolve()
        if root not in self.read_roots:
            self.read_roots.append(root)

    def _checked(self, path: str, write: bool = True) -> Path:
        """``path`` resolved, when it names a place inside an allowed run directory (or,
        for a read, a folder allowed for reading)."""
        given = PurePosixPath(path)
        if not given.is_absolute() or ".." in given.parts:
            raise PermissionError(f"file sink: {path!r} is not an absolute path without '..'")
        p = Path(path).resolve()
        roots = self.roots if write else [*self.roots, *self.read_roots]
        if not any(p == r or r in p.parents for r in roots):
            raise PermissionError(f"file sink: {path} is outside the run directories {roots}")
        return p

    def _member(self, root: Path, rel: str) -> Path:
        """``root / rel`` for a relative ``rel`` that stays inside ``root``."""
        try:
            return inside(root, rel)
        except ManifestError as e:
            raise PermissionError(f"file sink: {e}") from None

    def put(self, path: str, offset: int, data: bytes, last: bool, from_node: str) -> None:
        """Chunk ``data`` of ``path`` at ``offset``; ``last``: the file is complete and
        replaces ``path`` atomically (a reader never sees half a file)."""
        p = self._checked(path)
        part = p.with_name(p.name + PARTIAL)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "wb" if offset == 0 else "r+b") as f:
            f.seek(offset)
            f.write(data)
            if last:
                f.flush()
                os.fsync(f.fileno())
        if last:
            os.replace(part, p)
            self._record(p, offset + len(data), from_node)

    def append(self, path: str, data: bytes) -> None:
        p = self._checked(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "ab") as f:
            f.write(data)

    def count(self, folder: str, pattern: str) -> int:
        """Files in ``folder`` matching ``pattern`` (a file name pattern, no ``/``)."""
        d = self._checked(folder, write=False)
        if "/" in pattern or ".." in pattern:
            raise PermissionError(f"file sink: pattern {pattern!r} must name files of {folder}")
        return len(list(d.glob(pattern))) if d.is_dir() else 0

    def reset_dir(self, path: str, subdirs: list[str]) -> None:
        """An empty ``path`` holding the empty ``subdirs`` (a checkpoint's ``.tmp`` before
        ranks write into it)."""
        p = self._checked(path)
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        for sub in subdirs:
            self._member(p, sub).mkdir(parents=True)

    def seal_checkpoint(self, tmp: str, root: str) -> str:
        """What a local rank 0 does once every file is in ``tmp``: manifest, fsync, switch."""
        t, r = self._checked(tmp), self._checked(root)
        seal(t, r)
        return str(r)

    def verify(self, path: str) -> str | None:
        """None when every file of ``path`` matches its manifest (every CRC), else why not."""
        try:
            check_manifest(self._checked(path, write=False), full=True)
            return None
        except (ManifestError, OSError, ValueError) as e:
            return str(e)

    def list_files(self, root: str, skip: list[str]) -> list[tuple[str, int]]:
        """``(relative path, bytes)`` of every file under ``root`` but the top-level ``skip``;
        a symlink leading out of ``root`` is refused."""
        r = self._checked(root, write=False)
        out = []
        for p in sorted(r.rglob("*")):
            rel = str(p.relative_to(r))
            if p.is_file() and p.relative_to(r).parts[0] not in skip:
                out.append((rel, self._member(r, rel).stat().st_size))
        return out

    def get(self, root: str, rel: str, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` of the file ``rel`` (relative) under ``root``."""
        p = self._member(self._checked(root, write=False), rel)
        with open(p, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def stats(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes}

    def _record(self, p: Path, size: int, from_node: str) -> None:
        self.files += 1
        self.bytes += size
        root = next(r for r in self.roots if p == r or r in p.parents)
        rec = {
            "t": time.time(),
            "path": str(p.relative_to(root)),
            "bytes": size,
            "from_node": from_node,
            "to_node": self.node_id,
        }
        with open(root / RECORD, "a") as f:
            f.write(json.dumps(rec) + "\n")


def start_sink() -> ActorHandle:
    """The driver's sink on its own node (after joining a cluster). Creating it costs a
    worker start, so a local Ray (one node, the driver's files) has none."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    global _driver_sink
    here = ray.get_runtime_context().get_node_id()
    _driver_sink = (
        ray.remote(FileSink)
        .options(
            name=SINK_NAME,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        .remote()
    )
    return _driver_sink


def forget_sink() -> None:
    """A local Ray: no sink (a handle from an earlier cluster run in this process is stale)."""
    global _driver_sink
    _driver_sink = None


def allow_run_dir(run_dir: str | Path) -> None:
    """Let the driver's sink write under ``run_dir`` (nothing without a sink)."""
    if _driver_sink is not None:
        import ray

        ray.get(_driver_sink.allow.remote(str(run_dir)))


def allow_reads_from(folder: str | Path) -> None:
    """Let the driver's sink serve the files under ``folder`` (a checkpoint to resume
    from outside the run directory); nothing without a sink."""
    if _driver_sink is not None:
        import ray

        ray.get(_driver_sink.allow_reads.remote(str(folder)))
