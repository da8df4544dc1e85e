"""Find and kill every process of a node.

Nodes have no PID namespace (they must survive the server, and a PID
namespace dies with its init), so "the node's processes" are those whose
network or mount namespace is the node's: the same scan ``ip netns pids``
does, over ``/proc/*/ns/{net,mnt}``, matched by namespace (device, inode).
A process that entered only one of the two is still caught.

Blocking; callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import signal
import time

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
        for kind in ("net", "mnt"):
            try:
                st = os.stat(f"/proc/{entry.name}/ns/{kind}")
            except OSError:
                break  # exited, or a zombie (no namespaces left)
            if (st.st_dev, st.st_ino) in namespaces:
                found.append(int(entry.name))
                break
    return found


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
