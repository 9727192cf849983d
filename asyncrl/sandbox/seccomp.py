"""The seccomp filter every sandboxed process runs under: a classic BPF program, built
here by hand (no library) and handed to bubblewrap (``bwrap --seccomp FD``), which loads
it right before it starts the harness; every case child inherits it.

    arch is not this machine's ─────────────────────▶ kill the process
    socket / socketpair: family not AF_UNIX/INET/INET6 ▶ EAFNOSUPPORT (AF_VSOCK, AF_PACKET, ...)
    unshare / clone with CLONE_NEWUSER ──────────────▶ EPERM (no user namespace inside)
    clone3 ──────────────────────────────────────────▶ ENOSYS (its flags are out of reach of
                                                        BPF; glibc falls back to clone)
    memfd_create, shmget, msgget ────────────────────▶ EPERM (memory no limit of ours counts)
    io_uring_*, bpf, userfaultfd, perf_event_open, keyctl, add_key, request_key, ptrace,
    mount, umount2, pivot_root, setns, kexec_*, *_module, open_by_handle_at ─▶ EPERM
    anything else ───────────────────────────────────▶ allowed

One sock_filter is ``struct {u16 code; u8 jt; u8 jf; u32 k}``; the program reads
``struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}`` (args[i] at 16 + 8 i; the
low 32 bits come first on both supported, little-endian, machines)."""

from __future__ import annotations

import errno
import platform
import struct

LD_ABS, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|..., BPF_RET|K
RET_ALLOW, RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16
CLONE_NEWUSER = 0x10000000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
X32_SYSCALL_BIT = 0x40000000

# machine -> (AUDIT_ARCH_*, syscall numbers); only names a machine has are filtered
ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "socket": 41, "socketpair": 53, "clone": 56, "unshare": 272, "clone3": 435,
        "memfd_create": 319, "shmget": 29, "msgget": 68, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321, "userfaultfd": 323,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "ptrace": 101, "mount": 165, "umount2": 166, "pivot_root": 155, "setns": 308,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "open_by_handle_at": 304,
    }),
    "aarch64": (0xC00000B7, {
        "socket": 198, "socketpair": 199, "clone": 220, "unshare": 97, "clone3": 435,
        "memfd_create": 279, "shmget": 194, "msgget": 186, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280, "userfaultfd": 282,
        "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "ptrace": 117, "mount": 40, "umount2": 39, "pivot_root": 41, "setns": 268,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "open_by_handle_at": 265,
    }),
}  # fmt: skip
DENIED = [name for name in ARCHES["x86_64"][1] if name not in
          ("socket", "socketpair", "clone", "unshare", "clone3")]  # fmt: skip


def insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def errno_ret(e: int) -> int:
    return 0x00050000 | e  # SECCOMP_RET_ERRNO | errno


def supported() -> bool:
    return platform.machine() in ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one) as the bytes bwrap reads."""
    arch, nr = ARCHES[machine or platform.machine()]
    out = [insn(LD_ABS, OFF_ARCH), insn(JEQ, arch, 1, 0), insn(RET, RET_KILL_PROCESS)]
    out.append(insn(LD_ABS, OFF_NR))
    if arch == ARCHES["x86_64"][0]:  # x32 numbers reach the same calls another way
        out += [insn(JGE, X32_SYSCALL_BIT, 0, 1), insn(RET, errno_ret(errno.ENOSYS))]
    for name in ("socket", "socketpair"):
        out += _if_nr(nr[name], _families())
    for name in ("unshare", "clone"):
        out += _if_nr(nr[name], _no_newuser())
    out += _if_nr(nr["clone3"], [insn(RET, errno_ret(errno.ENOSYS))])
    for name in DENIED:
        out += _if_nr(nr[name], [insn(RET, errno_ret(errno.EPERM))])
    out.append(insn(RET, RET_ALLOW))
    return b"".join(out)


def _if_nr(number: int, block: list[bytes]) -> list[bytes]:
    """``block`` (which ends in returns) runs only for syscall ``number``; A keeps the
    syscall number for the next test otherwise."""
    return [insn(JEQ, number, 0, len(block)), *block]


def _families() -> list[bytes]:
    allow = (AF_UNIX, AF_INET, AF_INET6)
    body = [insn(LD_ABS, OFF_ARG0)]
    for i, fam in enumerate(allow):
        body.append(insn(JEQ, fam, len(allow) - i, 0))  # to the allow at the end
    body += [insn(RET, errno_ret(errno.EAFNOSUPPORT)), insn(RET, RET_ALLOW)]
    return body


def _no_newuser() -> list[bytes]:
    return [
        insn(LD_ABS, OFF_ARG0),
        insn(JSET, CLONE_NEWUSER, 0, 1),
        insn(RET, errno_ret(errno.EPERM)),
        insn(RET, RET_ALLOW),
    ]
