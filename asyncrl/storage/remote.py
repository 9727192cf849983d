"""The rank's side of the file sink (sink.py): is this process on the driver's node, and
if not, moving whole files and trees to and from the driver's run directory.

On the driver's node (always so with a local Ray) :func:`remote_sink` is None and the
callers write in place, as they always did: no copy, no extra call after the first
look-up (cached per job). Elsewhere they write to :func:`staging` on this node, then
:func:`upload` it; a resume :func:`download` s the checkpoint first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.storage.sink import SINK_NAME

if TYPE_CHECKING:
    from ray.actor import ActorHandle

CHUNK = 16 << 20  # bytes per call: large files never sit whole in the object store
_cache: dict[str, Any] = {}  # job id -> the sink, or None when on the driver's node


def remote_sink() -> ActorHandle | None:
    """The driver's FileSink when this process runs on another node, else None."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    job = ctx.get_job_id()
    if job not in _cache:
        try:
            sink = ray.get_actor(SINK_NAME)
        except ValueError:  # none started: a local Ray, the driver's node and files
            sink = None
        if sink is not None and ray.get(sink.node.remote()) == ctx.get_node_id():
            sink = None
        _cache[job] = sink
    return _cache[job]


def call(ref: Any) -> Any:
    import ray

    return ray.get(ref)


def this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def staging(name: str) -> Path:
    """A fresh folder on this node for files on their way to (or from) the driver."""
    d = Path(tempfile.gettempdir()) / "asyncrl-staging" / f"{os.getpid()}-{name}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def upload_file(sink: ActorHandle, local: Path, remote: str) -> None:
    import ray

    node, size, offset = this_node(), local.stat().st_size, 0
    with open(local, "rb") as f:
        while True:
            data = f.read(CHUNK)
            offset_next = offset + len(data)
            ray.get(sink.put.remote(remote, offset, data, offset_next >= size, node))
            if offset_next >= size:
                return
            offset = offset_next


def upload(sink: ActorHandle, local: Path, remote: str | Path) -> int:
    """Every file under ``local`` to the same relative path under ``remote``; count."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    for p in files:
        upload_file(sink, p, str(Path(remote) / p.relative_to(local)))
    return len(files)


def download(
    sink: ActorHandle, remote: str | Path, local: Path, skip: tuple[str, ...] = ()
) -> None:
    """Every file under the driver's ``remote`` (but the top-level ``skip``) into ``local``."""
    import ray

    for rel, size in ray.get(sink.list_files.remote(str(remote), list(skip))):
        out = local / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            for offset in range(0, max(size, 1), CHUNK):
                f.write(ray.get(sink.get.remote(str(remote), rel, offset, CHUNK)))
