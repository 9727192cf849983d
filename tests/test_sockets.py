"""A default run listens on loopback only (issue 25; docs/security.md).

The real `python -m asyncrl.train` with the default config: once it trains (so the
weight broker's group is up), every TCP socket in LISTEN state owned by a process of
the run (its process tree, and whatever carries its ASYNCRL_RUN mark) must be bound to
a loopback address, unless docs/security.md lists it. Then SIGTERM stops it (exit 130).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
from pathlib import Path

import pytest
from test_signals import run_mark, start_run, tree, wait_steps

# Non-loopback listeners a default run may have: docs/security.md, "What listens where".
ALLOWED: set[str] = set()


def _addr(hexaddr: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6}: little-endian 32-bit words of hex, then the port."""
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


def listening(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, command name, address, port) of every TCP socket in LISTEN state that one of
    ``pids`` holds (socket inodes of /proc/<pid>/fd matched to /proc/net/tcp{,6})."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # TCP_LISTEN
                inodes[int(cols[9])] = _addr(cols[1])
    rows = set()
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                rows.add((pid, name, *inodes[int(target[8:-1])]))
    return sorted(rows)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


@pytest.mark.slow
def test_a_default_run_listens_on_loopback_only(tmp_path, tiny_model):
    from asyncrl.utils.watchdog import marked

    out = tmp_path / "run"
    p = start_run(out)
    try:
        wait_steps(p, out, 2)  # trained and published: the broker's group is up
        procs = tree(p.pid)
        pids = sorted(set(procs) | set(marked(run_mark(procs))))
        rows = listening(pids)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    for row in rows:
        print(row)
    names = {n for _, n, _, _ in rows}
    assert {"gcs_server", "raylet"} <= names, rows  # Ray's servers were seen
    bad = [r for r in rows if not is_loopback(r[2]) and r[1] not in ALLOWED]
    assert not bad, f"listening beyond loopback: {bad}"
    assert rc == 130, (out / "stderr.txt").read_text()[-3000:]
    assert "stopped by SIGTERM" in (out / "stderr.txt").read_text().strip().splitlines()[-1]
