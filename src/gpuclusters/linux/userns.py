"""A node's user namespace: root in the node is nobody on the host.

Each node runs in its own user namespace whose ids 0-65535 map onto its
project's host id block (core/idblocks.py). The namespace is made before
the node's network namespace, which it then owns, and pinned at
``<ns_dir>/<id>.user`` for the node's life (a reboot keeps both, like the
netns); every other namespace of the node is made inside it by the node's
boot (``_nsinit``).

What the node owns on the host (its root directory, overlay layers, /tmp,
/scratch, container state, its cgroup) is owned by the block's ids: files
the server writes there are *shifted* (:func:`shift_tree`: host id = first
+ node id). What the node shares read-only with the host (/usr and the
other top-level directories, /etc and /var's lower layers, the binary
caches) is bound through an *idmapped mount*, which shows the host's root
as the node's root without changing a byte on disk.

The helper that makes and pins namespaces is ``_userns.py``, a separate
process: unshare(2) of a user namespace needs a single-threaded caller.
One is kept per server process (:class:`_Helper`, its ``serve`` mode), so
that a node's boot does not start a Python interpreter for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from gpuclusters.core.idblocks import (
    BLOCK_SIZE,
    DEFAULT_START,
    IdBlock,
    check_host_ranges,
    max_blocks,
    parse_passwd_ids,
    parse_subordinate,
)
from gpuclusters.linux import sysmount

HELPER = Path(__file__).with_name("_userns.py")


async def ensure(path: Path, ids: IdBlock, *, netns: Path | None = None) -> bool:
    """The pinned user namespace at ``path``; returns whether it is new.
    ``netns``: where no namespace is pinned yet, a new user namespace comes
    with a network namespace it owns, pinned there (one helper process for
    both, as :func:`make_netns` would make it)."""
    if sysmount.is_ns_file(path):
        if mapped_first(path) == ids.first:
            return False
        sysmount.unmount(path)  # made for another block, or unrecorded
    args = ["user", str(path), str(ids.first)]
    if netns is not None and not sysmount.is_ns_file(netns):
        netns.parent.mkdir(parents=True, exist_ok=True)
        args.append(str(netns))
    await asyncio.to_thread(_HELPER.call, args)
    record(path, ids)
    return True


async def make_netns(user: Path, path: Path) -> None:
    """A network namespace owned by the pinned user namespace ``user``,
    pinned at ``path`` (``/run/netns/<name>``: ``ip netns`` finds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(_HELPER.call, ["net", str(user), str(path)])


class HelperError(OSError):
    """The namespace helper refused or failed a request."""


class _Helper:
    """The kept ``_userns.py serve`` process of this process, started on
    first use and again if it died; requests go one at a time (a lock), from
    any thread or event loop. It ends when this process does (its input
    closes)."""

    TIMEOUT_S = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", str(HELPER), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def call(self, args: list[str]) -> None:
        if any("\t" in a or "\n" in a for a in args):
            raise ValueError(f"namespace helper arguments may not hold tabs or newlines: {args}")
        request = ("\t".join(args) + "\n").encode()
        with self._lock:
            answer = b""
            for _ in range(2):  # a helper found dead is started again, once
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                proc = self._proc
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(request)
                    proc.stdin.flush()
                except BrokenPipeError:
                    self._stop()
                    continue
                ready, _, _ = select.select([proc.stdout], [], [], self.TIMEOUT_S)
                if not ready:
                    self._stop()
                    raise HelperError(0, f"namespace helper: no answer in {self.TIMEOUT_S:.0f}s")
                answer = proc.stdout.readline()
                if answer:
                    break
                self._stop()
        text = answer.decode(errors="replace").strip()
        if text != "ok":
            raise HelperError(0, f"namespace helper: {text.removeprefix('error ') or 'died'}")

    def _stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None


_HELPER = _Helper()


def idmap_refusal(paths: list[Path], first: int = DEFAULT_START) -> str | None:
    """Why nodes on this host cannot have user namespaces (its file systems
    refuse idmapped mounts of ``paths``: what nodes share from it), or None
    where they can. Leaves nothing behind."""
    argv = [sys.executable, "-I", "-S", str(HELPER), "probe", str(first), *map(str, paths)]
    r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if r.returncode == 0:
        return None
    return r.stderr.strip().removeprefix("userns: ") or f"the probe exited {r.returncode}"


def mapped_first(path: Path) -> int | None:
    """The first host id of a pinned user namespace's map. The kernel shows
    a map only through a process in the namespace, and none stays in it, so
    the map is recorded beside the pin when it is made."""
    try:
        return int(_map_record(path).read_text())
    except (OSError, ValueError):
        return None


def _map_record(path: Path) -> Path:
    return path.with_suffix(".userids")


def record(path: Path, ids: IdBlock) -> None:
    _map_record(path).write_text(f"{ids.first}\n")


def forget(path: Path) -> None:
    sysmount.unmount(path)
    path.unlink(missing_ok=True)
    _map_record(path).unlink(missing_ok=True)


def shift_tree(root: Path, ids: IdBlock) -> int:
    """Give every file below ``root`` (and ``root``) the block's ids: a
    node id ``n`` (an owner below 65536) becomes ``first + n``; owners
    already in the block, or elsewhere, stay. Symlinks are changed, not
    followed. Returns how many entries changed."""
    changed = 0

    def own(path: str, st: os.stat_result) -> None:
        nonlocal changed
        uid = st.st_uid + ids.first if st.st_uid < BLOCK_SIZE else st.st_uid
        gid = st.st_gid + ids.first if st.st_gid < BLOCK_SIZE else st.st_gid
        if (uid, gid) != (st.st_uid, st.st_gid):
            os.lchown(path, uid, gid)
            # chown clears set-id bits; a shifted setuid file keeps them.
            if st.st_mode & 0o6000 and not os.path.islink(path):
                os.chmod(path, st.st_mode & 0o7777)
            changed += 1

    if not root.exists():
        return 0
    own(str(root), os.lstat(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            own(path, os.lstat(path))
    return changed


def adopt(volume: Path, ids: IdBlock) -> int:
    """Give a shared volume's files to the project's block, once: a volume
    whose root is owned by a node id (below 65536: made before its nodes
    had user namespaces, or by the volume store as host root) is shifted;
    one whose root is in a block already is left as it is. Nothing is
    removed or rewritten but owners. Returns how many entries changed."""
    if os.lstat(volume).st_uid >= BLOCK_SIZE:
        return 0
    return shift_tree(volume, ids)


def check_host_ids(start: int = DEFAULT_START, etc: Path = Path("/etc")) -> None:
    """Refuse (IdBlockError) id blocks from ``start`` up that meet an id
    this host uses: its accounts and groups, its subordinate ranges."""
    used: list[tuple[int, int]] = []
    for name in ("passwd", "group"):
        with contextlib.suppress(OSError):
            used += [(i, i) for i in parse_passwd_ids((etc / name).read_text())]
    for name in ("subuid", "subgid"):
        with contextlib.suppress(OSError):
            used += parse_subordinate((etc / name).read_text())
    check_host_ranges(start, max_blocks(start), used)
