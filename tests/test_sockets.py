"""A default run listens on loopback only (issue 25; docs/security.md).

The check runs inside tests/test_signals.py's SIGINT test (one real default run serves
both): once it trains (so the weight broker's group is up), every TCP socket in LISTEN
state owned by a process of the run (its process tree, and whatever carries its
ASYNCRL_RUN mark) must be bound to a loopback address, unless docs/security.md lists it.
Here: the lister, on this process's own sockets.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

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


def test_the_lister_sees_what_a_process_listens_on():
    """The lister itself, on sockets of this process: loopback, every interface, and a
    connected (not listening) one it must leave out."""
    socks = []
    for host in ("127.0.0.1", "0.0.0.0"):
        s = socket.socket()
        s.bind((host, 0))
        s.listen(1)
        socks.append(s)
    client = socket.create_connection(socks[0].getsockname())
    try:
        mine = {(a, port) for _, _, a, port in listening([os.getpid()])}
        want = {(h, s.getsockname()[1]) for h, s in zip(("127.0.0.1", "0.0.0.0"), socks)}
        assert want <= mine
        assert client.getsockname()[1] not in {port for _, port in mine}
        assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1")
        assert not is_loopback("0.0.0.0") and not is_loopback("::")
    finally:
        client.close()
        for s in socks:
            s.close()


def assert_loopback_only(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """Fails on a listener of ``pids`` beyond loopback and not in ALLOWED; returns all."""
    rows = listening(pids)
    names = {n for _, n, _, _ in rows}
    assert {"gcs_server", "raylet"} <= names, rows  # Ray's servers were seen
    bad = [r for r in rows if not is_loopback(r[2]) and r[1] not in ALLOWED]
    assert not bad, f"listening beyond loopback: {bad}"
    return rows
