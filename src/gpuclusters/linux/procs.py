"""Find and kill every process of a node.

A node's processes are those of its PID namespace: killing its init kills
them all (:func:`kill_init`). What may be left is found by namespace: every
process whose network, mount or PID namespace is the node's, the same scan
``ip netns pids`` does, over ``/proc/*/ns/{net,mnt,pid}``, matched by
namespace (device, inode): a helper that joined the node's namespaces from
the host's PID namespace, or a process that entered only one of them.

Containers a node's kubelet starts have namespaces of their own, so they
are found by cgroup instead: everything below the node's cgroup name
(``/sys/fs/cgroup/<controller>/gpc-<id>``) in any v1 controller. Those
cgroup directories are removed once empty, deepest first.

Blocking; callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gpuclusters.linux import _nodeops, nodecgroup

CGROUP_ROOT = Path("/sys/fs/cgroup")

NsId = tuple[int, int]


class ProcessesSurviveError(RuntimeError):
    pass


def pids_in(namespaces: set[NsId]) -> list[int]:
    """Pids of live processes in any of ``namespaces`` (zombies have none)."""
    if not namespaces:
        return []
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        for kind in ("net", "mnt", "pid"):
            try:
                st = os.stat(f"/proc/{entry.name}/ns/{kind}")
            except OSError:
                break  # exited, or a zombie (no namespaces left)
            if (st.st_dev, st.st_ino) in namespaces:
                found.append(int(entry.name))
                break
    return found


def process_running(pid: int) -> bool:
    """Not gone and not a zombie (one left for this machine's init to reap:
    a detached process whose parent has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """A process's command line ([] if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def start_time(pid: int) -> str | None:
    """A live process's start time (clock ticks since boot, as text), from
    /proc/<pid>/stat; None if it is gone or a zombie."""
    info = _nodeops.proc_start(pid)
    return None if info is None or info[0] in ("Z", "X") else info[1]


def pid_ns(pid: int) -> NsId | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def kill_init(pid: int | None, *, timeout_s: float = 5.0) -> int:
    """SIGKILL a node's init (``None``: it does not run) and wait until it
    is gone; the kernel kills the rest of its PID namespace. Returns how
    many processes were killed (1 or 0)."""
    if pid is None:
        return 0
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    deadline = time.monotonic() + timeout_s
    while start_time(pid) is not None:
        if time.monotonic() > deadline:
            raise ProcessesSurviveError(f"the node's init (pid {pid}) survives SIGKILL")
        time.sleep(0.005)
    return 1


def kill_all(namespaces: set[NsId], *, timeout_s: float = 5.0) -> int:
    """SIGKILL every process in ``namespaces`` until none is left (they may
    fork while we kill). Returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while pids := pids_in(namespaces):
        if time.monotonic() > deadline:
            raise ProcessesSurviveError(f"processes survive SIGKILL: {sorted(pids)[:20]}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        # Death is asynchronous: the namespaces are released during exit.
        time.sleep(0.005)
    return len(killed)


def _cgroup_dirs(name: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Every directory of cgroup ``name`` in every mounted hierarchy (v1) or
    the unified one (v2), deepest first."""
    found: list[Path] = []
    if not root.is_dir():
        return found
    # v1: whatever is below any hierarchy (a hybrid's "unified" too).
    tops = [root / name] if nodecgroup.is_v2(root) else [h / name for h in root.iterdir()]
    for top in tops:
        if not top.is_dir() or top.is_symlink():
            continue
        for dirpath, _dirs, _files in os.walk(top):
            found.append(Path(dirpath))
    found.sort(key=lambda p: len(p.parts), reverse=True)
    return found


def cgroup_pids(name: str, root: Path = CGROUP_ROOT) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_dirs(name, root):
        try:
            text = (d / "cgroup.procs").read_text()
        except OSError:
            continue
        pids.update(int(x) for x in text.split())
    pids.discard(os.getpid())
    return pids


def kill_cgroup(name: str, *, timeout_s: float = 5.0, root: Path = CGROUP_ROOT) -> int:
    """SIGKILL every process in cgroup ``name`` (and below) until none is left."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while pids := cgroup_pids(name, root):
        if time.monotonic() > deadline:
            raise ProcessesSurviveError(f"processes survive SIGKILL: {sorted(pids)[:20]}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return len(killed)


def remove_cgroup(name: str, *, timeout_s: float = 5.0, root: Path = CGROUP_ROOT) -> None:
    """rmdir the (empty) cgroup tree ``name`` in every hierarchy. A cgroup
    whose last process is still exiting refuses with EBUSY for a moment."""
    deadline = time.monotonic() + timeout_s
    for d in _cgroup_dirs(name, root):
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
