"""Mount syscalls for the host side, through ctypes (Python 3.11 has no
``os.mount``), plus the small queries the provider needs.

These run in the server's own (host) mount namespace and are blocking:
callers wrap them in ``asyncio.to_thread``. They are syscalls, not programs,
which keeps a node's delete path free of a dozen ``umount`` executions.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path

MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _libc().mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {source} on {target}")


def unmount(target: Path) -> bool:
    """Lazily detach the mount at ``target``; False if nothing was mounted."""
    rc = _libc().umount2(str(target).encode(), MNT_DETACH)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(err, f"umount {target}: {os.strerror(err)}")
    return True


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points() -> list[str]:
    """Every mount point of this (the server's) mount namespace."""
    with open("/proc/self/mountinfo") as f:
        return [_unescape(line.split()[4]) for line in f]


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (deepest first, ready to unmount)."""
    base = str(path).rstrip("/")
    found = [m for m in mount_points() if m == base or m.startswith(base + "/")]
    return sorted(found, key=len, reverse=True)


def ensure_private_dir(path: Path) -> None:
    """Make ``path`` a private bind mount of itself (idempotent).

    A mount namespace can only be pinned by bind-mounting its nsfs file onto
    a file whose mount does not propagate into that same namespace, or the
    kernel would have a reference loop; unshare(1) therefore asks for the
    directory holding the files to be a private mount.
    """
    path.mkdir(parents=True, exist_ok=True)
    target = str(path)
    if target not in mount_points():
        mount(target, target, None, MS_BIND, None)
    # Private even if it already was a mount (another tool may have made it
    # shared); MS_PRIVATE on a private mount changes nothing.
    mount("none", target, None, MS_PRIVATE, None)


@functools.cache
def _nsfs_dev() -> int:
    return os.stat("/proc/self/ns/net").st_dev


def is_ns_file(path: Path) -> bool:
    """Whether ``path`` is a pinned namespace (an nsfs bind mount), not just
    a leftover empty file, as after a host reboot."""
    try:
        return os.stat(path).st_dev == _nsfs_dev()
    except OSError:
        return False


def ns_inode(path: Path) -> tuple[int, int] | None:
    """(device, inode) identifying the namespace pinned at ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st.st_dev == _nsfs_dev() else None
