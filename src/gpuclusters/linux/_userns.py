"""Make and pin a node's user namespace, or a network namespace owned by it.

Run by :mod:`gpuclusters.linux.userns` as ``python -I -S _userns.py``::

    user <pin file> <first host id> [<net pin file>]
                                        a user namespace mapping ids
                                        0-65535 onto first..first+65535
                                        (and a network namespace owned by
                                        it, in the same process)
    net <user pin> <pin file>           a network namespace owned by it
    probe <first host id> <path>...     whether this host can idmap the
                                        mounts at <path>... (nothing kept)
    serve                               the user and net commands as
                                        requests on stdin, one per line
                                        (arguments tab-separated), each
                                        answered "ok" or "error <why>" on
                                        stdout; ends at end of input

``serve`` is how a server runs it: one kept process, so a node's boot does
not pay for a Python interpreter's start (about 15 ms of a 100 ms boot).

A namespace is made by a child (unshare(2) of a user namespace needs a
single-threaded caller, and nothing may stay in it); this process, still
root in the host's namespaces, writes the id maps and binds the child's
``/proc/<pid>/ns/<kind>`` onto the pin file, which keeps the namespace
after the child exits. The child never execs: it waits on a pipe until the
pin is made and then exits.

A network namespace must be owned by the node's user namespace, not the
host's: only then does root in the node hold CAP_NET_ADMIN there (CNI
plugins, kube-proxy's iptables) and may mount a sysfs describing it.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
SIZE = 65536

libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _in_child(setup: object) -> int:
    """Fork a child that runs ``setup`` and then waits; returns its pid once
    ``setup`` is done (raises with the child's message if it failed)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            setup()  # type: ignore[operator]
            os.write(ready_w, b"ok")
        except OSError as exc:
            os.write(ready_w, str(exc).encode())
            os._exit(1)
        os.read(go_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    report = os.read(ready_r, 4096).decode()
    os.close(ready_r)
    if report != "ok":
        os.waitpid(pid, 0)
        raise OSError(0, report or "child died")
    global _release
    _release = go_w
    return pid


_release = -1


def _finish(pid: int) -> None:
    os.close(_release)
    os.waitpid(pid, 0)


def _pin(pid: int, kind: str, path: str) -> None:
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
    source = f"/proc/{pid}/ns/{kind}".encode()
    _check(libc.mount(source, path.encode(), None, ctypes.c_ulong(MS_BIND), None), f"pin {path}")


def make_user(path: str, first: int, net_path: str | None = None) -> None:
    def setup() -> None:
        _check(libc.unshare(CLONE_NEWUSER), "unshare user")
        if net_path is not None:
            # Owned by the new user namespace, in which this child holds
            # every capability from the unshare on (no map needed for that).
            _check(libc.unshare(CLONE_NEWNET), "unshare net")

    pid = _in_child(setup)
    try:
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"0 {first} {SIZE}\n")
        # setgroups stays allowed: the node's own root manages groups.
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"0 {first} {SIZE}\n")
        _pin(pid, "user", path)
        if net_path is not None:
            _pin(pid, "net", net_path)
    finally:
        _finish(pid)


def make_net(user_path: str, path: str) -> None:
    user_fd = os.open(user_path, os.O_RDONLY)

    def setup() -> None:
        _check(libc.setns(user_fd, CLONE_NEWUSER), "setns user")
        _check(libc.unshare(CLONE_NEWNET), "unshare net")

    pid = _in_child(setup)
    try:
        _pin(pid, "net", path)
    finally:
        _finish(pid)


def probe(first: int, paths: list[str]) -> None:
    """Idmap a detached copy of each path's mount tree through a throwaway
    user namespace, as a node's boot does (``_nsinit.idmapped_tree``); the
    first that fails raises. Some file systems cannot be idmapped (an
    overlayfs root, as in a container): nodes there cannot have user
    namespaces."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from gpuclusters.linux._nsinit import idmapped_tree

    pid = _in_child(lambda: _check(libc.unshare(CLONE_NEWUSER), "unshare user"))
    try:
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{kind}", "w") as f:
                f.write(f"0 {first} {SIZE}\n")
        user_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
        try:
            for path in paths:
                os.close(idmapped_tree(path, user_fd))
        finally:
            os.close(user_fd)
    finally:
        _finish(pid)


def _command(argv: list[str]) -> bool:
    """Run a user or net command; False where ``argv`` is neither."""
    if len(argv) in (3, 4) and argv[0] == "user":
        make_user(argv[1], int(argv[2]), argv[3] if len(argv) == 4 else None)
    elif len(argv) == 3 and argv[0] == "net":
        make_net(argv[1], argv[2])
    else:
        return False
    return True


def serve() -> int:
    for line in sys.stdin:
        try:
            answer = "ok" if _command(line.rstrip("\n").split("\t")) else "error bad request"
        except (OSError, ValueError) as exc:
            answer = "error " + " ".join(str(exc).split())
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        return serve()
    try:
        if _command(argv):
            pass
        elif len(argv) >= 3 and argv[0] == "probe":
            probe(int(argv[1]), argv[2:])
        else:
            print(
                "usage: _userns.py user PIN FIRST [NET_PIN] | net USER_PIN PIN"
                " | probe FIRST PATH... | serve",
                file=sys.stderr,
            )
            return 2
    except (OSError, ValueError) as exc:
        print(f"userns: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
