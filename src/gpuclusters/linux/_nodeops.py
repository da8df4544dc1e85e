"""File and daemon operations inside a node: the helper behind NamespaceShell.

It joins the node's network, UTS, IPC, PID and mount namespaces itself
(setns through ctypes; a single-threaded process may switch mount namespace,
the multi-threaded server may not) and then works with paths *inside* the
node, so it does not depend on anything being installed in the node.
Joining a PID namespace only places the joiner's *children* there, so once
inside, the helper forks a worker that does the ops: a process of the node,
whose pids (in pidfiles, in the node's /proc, for ``kill``) are the node's.
The worker dies with the helper (``PR_SET_PDEATHSIG``) and with the node.
Standard library builtins and ctypes only, everything imported before the
switch; marshal rather than JSON because start-up time is this helper's cost.

Two modes:

* one-shot: ``python -I -S _nodeops.py`` with one ``marshal``-encoded
  request on stdin, ``{"netns", "mnt", "uts", "ipc", "pid", "op", "args"}``; the result on
  stdout, errors one line on stderr, the op's exit status;
* serving: ``python -I -S _nodeops.py --serve``: frames on stdin and stdout
  (4-byte big-endian length + marshal). The first request names the
  namespaces (answered ``{"rc": 0}`` once inside), then each ``{"op",
  "args"}`` is answered ``{"rc", "out", "err"}``; EOF ends it. The server
  keeps a few of these per node (``shell.py``), so an op costs a round trip
  instead of a Python start (~20 ms, and a fork of the server).

Ops (``out`` is the result; ``rc`` 1 with a one-line ``err`` on failure):

``read``    the file's bytes; exit 2 if it does not exist
``write``   ``args["data"]`` written atomically (temp file + rename),
            parents created; prints ``changed`` or ``unchanged`` (same
            bytes, mode and owner: then nothing is written)
``spawn``   starts a daemon like ``setsid -f``: fork, fork again (the middle
            process exits at once, so the daemon belongs to init, never to a
            helper that lives on), setsid, exec; output appended to
            /var/log/gpuclusters/<name>.log, pidfile
            /run/gpuclusters-daemons/<name>.pid ("<pid> <starttime>") written
            by the daemon before exec; the helper waits until the exec
            happened (a close-on-exec pipe) so a bad argv is reported.
            Prints ``started``/``running``.
``status``  exit 0 and the pid if the daemon runs, else exit 3
``stop``    SIGTERM to the daemon's process group, SIGKILL after the timeout

A daemon counts as running only if its pid is alive (not a zombie), has the
start time recorded in the pidfile (pids get reused) and is still in this
node's network namespace.
"""

# try/except/pass instead of contextlib.suppress: contextlib's imports would
# add a fifth to this helper's start-up time.
# ruff: noqa: SIM105

from __future__ import annotations

import ctypes
import marshal
import os
import pwd
import sys
import time

# Not `from typing import ...`: typing (with re and enum) would double the
# start-up time. mypy treats this flag like typing.TYPE_CHECKING.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE = 4
CLONE_NEWCGROUP = 0x02000000
PR_SET_PDEATHSIG = 1
# Linux signal numbers; the signal module would pull in enum (slow start-up).
SIGKILL = 9
SIGTERM = 15
DAEMON_DIR = "/run/gpuclusters-daemons"
LOG_DIR = "/var/log/gpuclusters"
EXIT_MISSING = 2
EXIT_NOT_RUNNING = 3

libc = ctypes.CDLL("libc.so.6", use_errno=True)
RLIMIT_MEMLOCK = 8  # the generic Linux number: x86_64 and aarch64
RLIM_INFINITY = 2**64 - 1


class OpError(Exception):
    pass


class Rlimit(ctypes.Structure):
    _fields_ = (("cur", ctypes.c_uint64), ("max", ctypes.c_uint64))


def unlimit_memlock() -> None:
    """RLIMIT_MEMLOCK unlimited for this process and what it starts.

    A node has no init that all its processes descend from: daemons come
    from this helper (and from _nsinit at boot, which calls this too),
    commands from nsenter (shell.py raises the server's own limit for
    those). Each raises the limit, so every process of a node runs with it,
    as on a GPU/RDMA machine configured for it: ibverbs registers (pins)
    memory for RDMA, NCCL and CUDA pin host buffers, and Slurm hands the
    submitting process's limits on to jobs. Best effort: without
    CAP_SYS_RESOURCE the hard limit cannot be raised, then the soft limit
    goes up to it."""
    if libc.setrlimit(RLIMIT_MEMLOCK, ctypes.byref(Rlimit(RLIM_INFINITY, RLIM_INFINITY))) == 0:
        return
    current = Rlimit()
    if libc.getrlimit(RLIMIT_MEMLOCK, ctypes.byref(current)) == 0:
        libc.setrlimit(RLIMIT_MEMLOCK, ctypes.byref(Rlimit(current.max, current.max)))


# (device, inode) of the node's network namespace, set by ``enter``: the
# node's /proc has no /proc/self for a process outside its PID namespace.
NODE_NETNS: tuple[int, int] | None = None


def enter(request: dict[str, Any]) -> None:
    """Join the node's namespaces, then fork: the caller returns as the
    child, a process of the node's PID namespace (the parent waits for it and
    exits with its status)."""
    global NODE_NETNS
    # The node's share of the host bounds this helper and what it starts;
    # joined by the host path, before the node's own cgroup view.
    join_cgroups(request.get("cgroups", []))
    # Open all first: after the mount namespace switch the host paths are
    # gone. Mount last for the same reason. A node's user namespace comes
    # first: it owns the others, and entering it gives the rights to.
    order = [
        (request["netns"], CLONE_NEWNET),
        (request["uts"], CLONE_NEWUTS),
        (request["ipc"], CLONE_NEWIPC),
        (request["pid"], CLONE_NEWPID),
        (request["mnt"], CLONE_NEWNS),
    ]
    if "user" in request:
        order = [(request["user"], CLONE_NEWUSER), *order, (request["cgroupns"], CLONE_NEWCGROUP)]
    fds = [(os.open(path, os.O_RDONLY), flag) for path, flag in order]
    st = os.fstat(fds[1 if "user" in request else 0][0])
    NODE_NETNS = (st.st_dev, st.st_ino)
    for fd, flag in fds:
        if libc.setns(fd, flag) != 0:
            raise OpError(f"setns: {os.strerror(ctypes.get_errno())}")
        os.close(fd)
        if flag == CLONE_NEWUSER:
            # The node's root: ids 0 in it (host root is not mapped there).
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            os.setgroups([])
            # The change of credentials made it undumpable; the node's
            # root owns what it starts (its /proc files among them).
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.chdir("/")
    unlimit_memlock()  # for the daemons this helper spawns
    child = os.fork()
    if child == 0:
        # Gone with the helper the server kills (a timed-out op), and
        # never left behind if the helper died before this call: the
        # helper is outside the node's PID namespace, where getppid() says
        # 0; an orphan's parent is the node's init, 1.
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        if os.getppid() != 0:
            os._exit(1)
        return
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    exit_now(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def join_cgroups(procs_files: list[str]) -> None:
    """Move this process into the node's cgroup leaf (linux/nodecgroup.py):
    writing 0 to ``cgroup.procs`` moves the writer."""
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def reap_forever() -> None:
    """A node init's life after boot: reap whatever is reparented to it (the
    daemons, their orphans). Never returns."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)  # no child now; daemons may come later
        except InterruptedError:
            pass


def proc_start(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], fields[19]


def same_netns(pid: int) -> bool:
    try:
        a = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    if NODE_NETNS is not None:
        return (a.st_dev, a.st_ino) == NODE_NETNS
    b = os.stat("/proc/self/ns/net")  # the node's init: inside already
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def pidfile(name: str) -> str:
    return f"{DAEMON_DIR}/{name}.pid"


def running(name: str) -> int | None:
    try:
        with open(pidfile(name)) as f:
            pid_s, start = f.read().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    info = proc_start(pid)
    if info is None or info[0] in ("Z", "X") or info[1] != start:
        return None
    return pid if same_netns(pid) else None


def alive(pid: int) -> bool:
    info = proc_start(pid)
    return info is not None and info[0] not in ("Z", "X")


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def op_read(args: dict[str, Any]) -> tuple[int, bytes]:
    try:
        with open(args["path"], "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return EXIT_MISSING, b""
    return 0, data


def unchanged(path: str, data: bytes, mode: int, owner: tuple[int, int] | None) -> bool:
    try:
        st = os.stat(path)
        if st.st_mode & 0o7777 != mode:
            return False
        if owner is not None and (st.st_uid, st.st_gid) != owner:
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def op_write(args: dict[str, Any]) -> tuple[int, bytes]:
    path, data, mode, user = args["path"], args["data"], int(args["mode"]), args["owner"]
    owner = None
    if user is not None:
        try:
            pw = pwd.getpwnam(user)  # the node's /etc/passwd: we are inside
        except KeyError:
            raise OpError(f"no user {user!r} in the node") from None
        owner = (pw.pw_uid, pw.pw_gid)
    if unchanged(path, data, mode, owner):
        return 0, b"unchanged\n"
    parent = os.path.dirname(path) or "/"
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.gpc-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return 0, b"changed\n"


def daemon_child(name: str, argv: list[str], env: dict[str, str], report: int) -> None:
    """In the forked child: fork the daemon and exit, so the daemon is
    reparented to init at once. Never returns."""
    try:
        if os.fork() != 0:
            os._exit(0)
        # The daemon leads its own session and process group: ``stop``
        # signals the group.
        os.setsid()
        os.umask(0o022)
        log = os.open(f"{LOG_DIR}/{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # Nothing of the server's (pipes, sockets) may leak into the daemon;
        # ``report`` is close-on-exec and closes itself at exec.
        os.closerange(3, report)
        os.closerange(report + 1, os.sysconf("SC_OPEN_MAX"))
        info = proc_start(os.getpid())
        assert info is not None
        tmp = f"{pidfile(name)}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()} {info[1]}\n")
        os.replace(tmp, pidfile(name))
        os.execvpe(argv[0], argv, env)
    except BaseException as exc:
        try:
            os.write(report, f"{argv[0]}: {exc}".encode())
        except OSError:
            pass
    os._exit(127)


def op_spawn(args: dict[str, Any]) -> tuple[int, bytes]:
    name, argv, env = args["name"], list(args["argv"]), dict(args["env"])
    pid = running(name)
    if pid is not None:
        return 0, f"running {pid}\n".encode()
    os.makedirs(LOG_DIR, exist_ok=True)
    os.makedirs(DAEMON_DIR, exist_ok=True)
    r, w = os.pipe()  # both close-on-exec (PEP 446)
    middle = os.fork()
    if middle == 0:
        os.close(r)
        daemon_child(name, argv, env, w)
    os.close(w)
    os.waitpid(middle, 0)  # it exits right after forking the daemon
    chunks = []
    while chunk := os.read(r, 4096):  # EOF: the daemon exec'd (or died)
        chunks.append(chunk)
    os.close(r)
    if chunks:
        unlink_quietly(pidfile(name))
        raise OpError(b"".join(chunks).decode("utf-8", "replace"))
    pid = running(name)
    return 0, f"started {pid}\n".encode()


def op_status(args: dict[str, Any]) -> tuple[int, bytes]:
    pid = running(args["name"])
    if pid is None:
        return EXIT_NOT_RUNNING, b""
    return 0, f"{pid}\n".encode()


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def op_stop(args: dict[str, Any]) -> tuple[int, bytes]:
    name, timeout_s = args["name"], float(args["timeout_s"])
    pid = running(name)
    if pid is not None:
        # The daemon leads its own session and process group (setsid), so the
        # group signal reaches the children it forked too.
        signal_group(pid, SIGTERM)
        if not wait_gone(pid, timeout_s):
            signal_group(pid, SIGKILL)
            if not wait_gone(pid, 5.0):
                raise OpError(f"daemon {name} (pid {pid}) survived SIGKILL")
    unlink_quietly(pidfile(name))
    return 0, b"stopped\n"


OPS = {"read": op_read, "write": op_write, "spawn": op_spawn, "status": op_status, "stop": op_stop}


def dispatch(op: str, args: dict[str, Any]) -> tuple[int, bytes, bytes]:
    try:
        rc, out = OPS[op](args)
    except (OpError, OSError) as exc:
        return 1, b"", f"{op}: {exc}\n".encode()
    return rc, out, b""


def main() -> int:
    request = marshal.loads(sys.stdin.buffer.read())
    try:
        enter(request)
    except (OpError, OSError) as exc:
        print(f"{request['op']}: {exc}", file=sys.stderr)
        return 1
    rc, out, err = dispatch(request["op"], request["args"])
    sys.stdout.buffer.write(out)
    sys.stderr.buffer.write(err)
    return rc


def read_frame(stream: Any) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        return None  # EOF: the server closed its end (or died)
    size = int.from_bytes(head, "big")
    body = stream.read(size)
    if len(body) < size:
        return None
    return marshal.loads(body)


def write_frame(stream: Any, obj: Any) -> None:
    body = marshal.dumps(obj)
    stream.write(len(body).to_bytes(4, "big") + body)
    stream.flush()


def serve() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    hello = read_frame(stdin)
    if hello is None:
        return 0
    try:
        enter(hello)
    except (OpError, OSError) as exc:
        write_frame(stdout, {"rc": 1, "out": b"", "err": f"enter: {exc}\n".encode()})
        return 1
    write_frame(stdout, {"rc": 0, "out": b"", "err": b""})
    while (request := read_frame(stdin)) is not None:
        rc, out, err = dispatch(request["op"], request["args"])
        write_frame(stdout, {"rc": rc, "out": out, "err": err})
    return 0


def exit_now(code: int) -> None:
    # Skip interpreter finalisation: a few milliseconds per call, nothing
    # to clean up here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(serve() if sys.argv[1:] == ["--serve"] else main())
