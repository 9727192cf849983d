"""Hostile solutions to ``add(a, b)`` and the check that one was contained; shared by the
tests and ``benchmarks/sandbox.py``. Each program tries to earn reward without solving the
task, or to hurt the host. ``{tag}`` (unique per check) names what the program leaves
behind if it escapes: files ``<tmp>/asyncrl-hostile-{tag}*`` and processes whose command
line holds ``asyncrl-hostile-{tag}``."""

from __future__ import annotations

import glob
import os
import random
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncrl.sandbox.grading import Grade
from asyncrl.sandbox.runner import MARKER, STARTUP_GRACE_S

TEARDOWN_S = 1.0  # past the parent's hard deadline: SIGKILL, unmapping a hog's memory

CASES = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(20, 22)", "expected": 42}]
CORRECT = "def add(a, b):\n    return a + b\n"
REPO = str(Path(__file__).resolve().parents[2])
SECRET_ENV = "ASYNCRL_FAKE_SECRET"  # the tests set it in the grader's own environment

HOSTILE: dict[str, str] = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass\n",
    "sleep_forever": "import time\ndef add(a, b):\n    time.sleep(10**6)\n",
    "fork_bomb": "import os\ndef add(a, b):\n    while True:\n        try:\n"
    "            os.fork()\n        except OSError:\n            pass\n",
    "thread_bomb": "import threading, time\ndef add(a, b):\n    while True:\n        try:\n"
    "            threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
    "        except RuntimeError:\n            pass\n",
    "memory_hog": "def add(a, b):\n    x = []\n    while True:\n"
    "        x.append(bytearray(10**7))\n",
    "fork_memory_hog": """import os, time
def add(a, b):
    for _ in range(20):
        if os.fork() == 0:
            try:
                x = b'1' * (300 << 20)
            except MemoryError:
                pass
            time.sleep(60)
            os._exit(0)
    time.sleep(60)
""",
    "stack_overflow": "import sys\nsys.setrecursionlimit(10**8)\n"
    "def add(a, b):\n    return add(a, b) + 1\n",
    "huge_stdout": "def add(a, b):\n    while True:\n        print('x' * 100000)\n",
    "huge_file": "def add(a, b):\n    with open('big', 'wb') as f:\n        while True:\n"
    "            f.write(bytes(1 << 20))\n",
    "write_outside": """import os
def add(a, b):
    for d in ('/tmp', '{tmp}', '{repo}', '/work', '/root', '/etc', '..', '/var/tmp', '/dev/shm'):
        try:
            with open(os.path.join(d, 'asyncrl-hostile-{tag}'), 'w') as f:
                f.write('escaped')
        except OSError as e:
            print(d, e)
""",
    "read_host": """import os
def add(a, b):
    seen = [repr(dict(os.environ))]
    paths = ['/etc/shadow', '{repo}/README.md', '{repo}/pyproject.toml', '/root/.bashrc']
    paths += ['/proc/%s/%s' % (p, f) for p in os.listdir('/proc') if p.isdigit()
              for f in ('environ', 'cmdline')]
    for p in paths:
        try:
            seen.append(open(p, 'rb').read().decode('latin-1'))
        except OSError as e:
            seen.append(repr(e))
    print('\\n'.join(seen))
    return '\\n'.join(seen)[:1000]
""",
    "sockets": """import socket
def add(a, b):
    for fam, host in ((socket.AF_INET, '127.0.0.1'), (socket.AF_INET6, '::1')):
        for port in range(1, 65536, 4099):
            try:
                socket.create_connection((host, port), timeout=0.2)
                print('CONNECTED', host, port)
            except OSError:
                pass
    try:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.sendto(b'x', ('8.8.8.8', 53))
        print('SENT')
    except OSError as e:
        print('udp', e)
""",
    "kill_parent": """import os, signal
def add(a, b):
    for pid in (os.getppid(), 1):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as e:
            print(pid, e)
    os.killpg(0, signal.SIGKILL)
""",
    "detached_daemon": """import os, time
def add(a, b):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if os.fork() == 0:
                os.execv('/bin/sleep', ['asyncrl-hostile-{tag}', '30'])
            time.sleep(1.0)
            for d in ('/tmp', '{tmp}'):
                try:
                    open(os.path.join(d, 'asyncrl-hostile-{tag}-daemon'), 'w').write('x')
                except OSError:
                    pass
            time.sleep(30)
        os._exit(0)
    return None
""",
    "exit_early": "import os\nprint('OK')\nos._exit(0)\ndef add(a, b):\n    return a + b\n",
    "exit_early_sys": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "fake_pass_lines": "print('All tests passed!')\nprint('=== 2 passed in 0.01s ===')\n"
    "def add(a, b):\n    print('PASS: add(1, 2) == 3')\n    return None\n",
    "patch_machinery": """import builtins, json, sys, types
builtins.eval = lambda *a, **k: 3
builtins.isinstance = lambda *a, **k: True
json.dumps = lambda *a, **k: '{{"ok": true, "value": ["bool", true], "passed": true}}'
sys.modules['unittest'] = types.SimpleNamespace(TestCase=object, main=lambda *a, **k: None)
def add(a, b):
    assert False, 'never raised under python -O'
""",
    "forge_channel": """import os
FORGED = b'{{"nonce": "x", "cases": [{{"payload": "{{}}", "end": "exit 0"}}]}}'
PAYLOAD = b'{{"ok": true, "value": ["str", "passed"]}}'
def add(a, b):
    for fd in range(0, 1024):
        for data in (FORGED, PAYLOAD):
            try:
                os.write(fd, data)
            except OSError:
                pass
    for pid in ('self', '1', str(os.getppid())):
        try:
            fds = os.listdir('/proc/%s/fd' % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                with open('/proc/%s/fd/%s' % (pid, fd), 'wb') as f:
                    f.write(FORGED)
            except OSError:
                pass
    return 'passed'
""",
    "always_equal": """class Eq:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def add(a, b):
    return Eq()
""",
    "int_subclass": """class I(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return I(0)
""",
    "syntax_error": "def add(a, b) return a + b\n",
    # each of these earns the reward only if its attack works
    "sysv_shm": """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def add(a, b):
    for _ in range(3):  # 300 MB that no process maps, left behind if the IPC ns is the host's
        sid = libc.shmget(0, 100 << 20, 0o1600)
        if sid < 0:
            raise OSError(ctypes.get_errno(), 'shmget: ' + os.strerror(ctypes.get_errno()))
        addr = libc.shmat(sid, None, 0)
        ctypes.memset(addr, 1, 100 << 20)
        libc.shmdt(ctypes.c_void_p(addr))
    return a + b
""",
    "memfd_hog": """import os
def add(a, b):
    fd = os.memfd_create('asyncrl-hostile-{tag}')
    for _ in range(150):  # 150 MB that no address space holds
        os.write(fd, bytes(1 << 20))
    return a + b
""",
    "nested_userns": """import ctypes, os, subprocess
def add(a, b):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER: a new root, own caps
        return a + b
    r = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'],
                       capture_output=True, text=True)
    if r.stdout.strip() == '0':
        return a + b
    raise PermissionError('user namespace refused: ' + os.strerror(ctypes.get_errno()))
""",
    "hash_collision": """import json, os
def add(a, b):
    # every k * (2**61 - 1) hashes alike: a grader that builds the set or dict takes
    # quadratic time holding the GIL; the result fits under the 1 MiB result cap
    ints = [['int', str(k * (2 ** 61 - 1))] for k in range(25000)]
    value = ['set', ints] if a == 1 else ['dict', [[i, ['int', '1']] for i in ints[:15000]]]
    data = json.dumps({{'ok': True, 'value': value}}).encode()
    fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))
    fd = [f for f in fds if f > 2 and os.path.exists('/proc/self/fd/%d' % f)][0]  # the result pipe
    while data:
        data = data[os.write(fd, data):]
    os._exit(0)
""",
    "signal_games": """import os, signal, time
def add(a, b):
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU, signal.SIGALRM):
        signal.signal(s, signal.SIG_IGN)
    for pid in (1, os.getppid()):
        for s in (signal.SIGSTOP, signal.SIGTERM, signal.SIGSEGV):
            try:
                os.kill(pid, s)
            except OSError:
                pass
    if os.fork() == 0:
        os.setsid()
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped straggler
        os._exit(0)
    try:
        os.kill(-1, signal.SIGTERM)
    except OSError:
        pass
    while True:
        time.sleep(0.01)
""",
    "vsock": """import socket
def add(a, b):
    for fam, kind in ((socket.AF_VSOCK, socket.SOCK_STREAM), (socket.AF_PACKET, socket.SOCK_RAW),
                      (socket.AF_NETLINK, socket.SOCK_RAW)):
        socket.socket(fam, kind).close()  # raises where the family is refused
    return a + b
""",
    "binary_garbage": random.Random(0).randbytes(4096).decode("latin-1"),
}


def program(name: str, tag: str) -> str:
    """The named program with ``{tag}``, ``{tmp}`` and ``{repo}`` filled in."""
    src = HOSTILE[name]
    if name == "binary_garbage":
        return src
    return src.format(tag=tag, tmp=tempfile.gettempdir(), repo=REPO)


def new_tag() -> str:
    return secrets.token_hex(6)


@dataclass
class Containment:
    name: str
    contained: bool
    reasons: list[str]
    grade: Grade


def leftovers(tag: str, run_id: str) -> list[str]:
    """Processes and files an escaped program (or a sloppy sandbox) left on the host."""
    out = []
    needles = [f"asyncrl-hostile-{tag}".encode(), f"{MARKER}{run_id}".encode()]
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid.isdigit() and any(n in cmd for n in needles):
            out.append(f"process {pid}: {cmd[:80]!r}")
    for d in {tempfile.gettempdir(), "/tmp", REPO, "/work", "/root", "/etc", "/var/tmp"}:
        out += glob.glob(os.path.join(d, f"asyncrl-hostile-{tag}*"))
    out += glob.glob(os.path.join(tempfile.gettempdir(), f"{MARKER}{run_id}*"))
    return out


def check(name: str, g: Grade, tag: str, timeout_s: float) -> Containment:
    """Reward 0, finished by the parent's hard deadline (the time limit plus start-up
    grace) and its teardown, nothing left behind."""
    reasons = []
    if g.reward != 0:
        reasons.append(f"reward {g.reward}")
    if g.wall_s > timeout_s + STARTUP_GRACE_S + TEARDOWN_S:
        reasons.append(f"took {g.wall_s:.1f} s")
    reasons += leftovers(tag, g.run_id)
    secret = os.environ.get(SECRET_ENV)
    if secret and any(secret in s for s in (g.output, g.error, *(c.got for c in g.cases))):
        reasons.append("the grader's secret environment variable leaked")
    return Containment(name, not reasons, reasons, g)
