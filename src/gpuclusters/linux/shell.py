"""``NamespaceShell``: the ``core.nodeshell.NodeShell`` of a namespace node.

* ``run`` is ``nsenter --net --mount --uts --ipc --pid -- sh -c JOIN ...
  [runuser -u USER --] argv`` (nsenter forks into the node's PID namespace;
  the shell moves itself into the node's cgroup, then execs the command),
  with a clean environment (PATH, HOME, LANG plus the caller's ``env``):
  nothing of the server's environment (database URL, keys) reaches a node.
  nsenter's setns of the mount namespace also sets the root and working
  directory to the node's ``/``.
* files and daemons go through the :mod:`._nodeops` helper, which joins the
  node's namespaces itself and so works whatever is installed in the node.
  Helpers are kept running, a few per node (:class:`_Helpers`): an op is one
  round trip on a pipe instead of a Python start (~20 ms of CPU, and a
  vfork that blocks the server's event loop until the child execs). A
  helper lives inside the node's namespaces, so powering the node off kills
  it with everything else there; the next op notices (its namespaces have
  new identities, or the pipe is closed) and starts a fresh one. Every op is
  idempotent, so an op whose helper died under it is tried once more.
* ``exec_argv`` is the same nsenter line, for a terminal.

Timeouts of ``run`` come back as exit status 124, like timeout(1) (the
command's whole process group is killed). ``run`` waits until every process
holding its output exits, so a command that backgrounds a daemon (``cmd &``)
runs into the timeout: long-lived processes belong to ``spawn``.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import re
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuclusters.core.nodeshell import CommandResult, NodeCommandError, NodeShell
from gpuclusters.linux import nodecgroup
from gpuclusters.linux.layout import NODE_ENV, NodeLayout
from gpuclusters.linux.run import CommandError, CommandTimeoutError, Completed, run

NODEOPS = Path(__file__).with_name("_nodeops.py")
# sh -c JOIN sh <cgroup.procs files> -- argv: join each, then exec argv.
_JOIN = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'
TIMEOUT_EXIT = 124
_EXIT_MISSING = 2
_EXIT_NOT_RUNNING = 3
_DAEMON_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _node_path(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"node paths are absolute: {path!r}")
    return path


def _unlimit_memlock() -> None:
    """Raise this process's RLIMIT_MEMLOCK to unlimited (else its soft limit
    to the hard one), so that commands run in nodes inherit it: nodes run
    with memlock unlimited, see ``_nodeops.unlimit_memlock`` for why and for
    the other two places (boot daemons, spawned daemons). Commands run by
    nsenter descend from this process, which is why it is raised here: the
    server (or the CLI, for ``exec_argv``) has nothing else to pin."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == hard == resource.RLIM_INFINITY:
        return
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY,) * 2)
    except (OSError, ValueError):  # no CAP_SYS_RESOURCE: up to the hard limit
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))


class NamespaceShell:
    """A shell on one node, addressed by its pinned namespaces."""

    def __init__(self, node: NodeLayout, *, hostname: str, address: str) -> None:
        self._node = node
        self._hostname = hostname
        self._address = address

    @property
    def hostname(self) -> str:
        return self._hostname

    @property
    def address(self) -> str:
        return self._address

    @property
    def python(self) -> str:
        # Nodes see this process's interpreter and package at the same
        # paths (the provider shares them into every node).
        return sys.executable

    def _nsenter(self) -> list[str]:
        _unlimit_memlock()  # nsenter and the command inherit it
        # The command joins the node's cgroup (and so its limits) before it
        # enters the node, by its host path: nsenter cannot, a shell can
        # (writing 0 moves the writer), and inside a node in a user
        # namespace only the node's own view of the cgroups is mounted.
        files = nodecgroup.leaf_procs(self._node.cgroup_name)
        return ["sh", "-c", _JOIN, "sh", *files, "--", "nsenter", *self._node.nsenter_args(), "--"]

    @staticmethod
    def _as_user(user: str | None) -> list[str]:
        # runuser keeps the environment and sets HOME, SHELL, USER, LOGNAME.
        return ["runuser", "-u", user, "--"] if user else []

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        full = [*self._nsenter(), *self._as_user(user), *argv]
        try:
            done = await run(
                full, stdin=stdin, env={**NODE_ENV, **(env or {})}, timeout_s=timeout_s, check=False
            )
            result = CommandResult(done.returncode, _text(done.stdout), _text(done.stderr))
        except CommandTimeoutError:
            result = CommandResult(TIMEOUT_EXIT, "", f"timed out after {timeout_s:g}s")
        except CommandError as exc:  # nsenter itself could not start
            result = CommandResult(exc.returncode, "", str(exc))
        if check and result.returncode != 0:
            raise NodeCommandError(self._hostname, argv, result)
        return result

    async def _op(
        self,
        op: str,
        args: dict[str, Any],
        *,
        timeout_s: float = 30.0,
        ok: tuple[int, ...] = (0,),
    ) -> Completed:
        node = self._node
        what = [op, *(str(v) for k, v in args.items() if k != "data")]
        try:
            done = await _helpers_for(node).call(op, args, timeout_s=timeout_s)
        except _NoHelper:
            done = await self._op_once(op, args, timeout_s=timeout_s)
        except CommandError as exc:
            raise NodeCommandError(
                self._hostname, what, CommandResult(exc.returncode, "", str(exc))
            ) from exc
        if done.returncode not in ok:
            result = CommandResult(done.returncode, _text(done.stdout), _text(done.stderr))
            raise NodeCommandError(self._hostname, what, result)
        return done

    async def _op_once(self, op: str, args: dict[str, Any], *, timeout_s: float) -> Completed:
        """A one-shot helper: for a node whose namespaces are not all there
        (its error then names what is missing)."""
        request = {**_ns_request(self._node), "op": op, "args": args}
        argv = [sys.executable, "-I", "-S", str(NODEOPS)]
        return await run(argv, stdin=marshal.dumps(request), timeout_s=timeout_s, check=False)

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        if not _DAEMON_NAME.match(name):
            raise ValueError(f"bad daemon name {name!r}")
        if not argv:
            raise ValueError("empty argv")
        await self._op(
            "spawn", {"name": name, "argv": list(argv), "env": {**NODE_ENV, **(env or {})}}
        )

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        await self._op("stop", {"name": name, "timeout_s": timeout_s}, timeout_s=timeout_s + 15)

    async def is_running(self, name: str) -> bool:
        done = await self._op("status", {"name": name}, ok=(0, _EXIT_NOT_RUNNING))
        return done.returncode == 0

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        args = {"path": _node_path(path), "data": bytes(data), "mode": mode, "owner": owner}
        done = await self._op("write", args)
        return done.stdout.strip() == b"changed"

    async def read_file(self, path: str) -> bytes | None:
        done = await self._op("read", {"path": _node_path(path)}, ok=(0, _EXIT_MISSING))
        return done.stdout if done.returncode == 0 else None

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        # The caller's environment would leak into the node otherwise; TERM
        # is set because an interactive shell needs one.
        env = [f"{k}={v}" for k, v in NODE_ENV.items()] + ["TERM=xterm-256color"]
        return [*self._nsenter(), "env", "-i", *env, *self._as_user(user), *argv]


# --- kept helpers --------------------------------------------------------------------------

MAX_IDLE_HELPERS = 4  # per node: ops on one node rarely run more than this at once


class _NoHelper(Exception):
    """The node's namespaces are not all pinned: no helper can enter them."""


class _HelperDied(Exception):
    """The helper's pipe closed before it answered."""


def _ns_request(node: NodeLayout) -> dict[str, Any]:
    return {
        "cgroups": nodecgroup.leaf_procs(node.cgroup_name),
        "netns": str(node.netns_path),
        "mnt": str(node.mnt_file),
        "uts": str(node.uts_file),
        "ipc": str(node.ipc_file),
        "pid": str(node.pid_file),
        **({"user": str(node.user_file), "cgroupns": str(node.cgroup_file)} if node.userns else {}),
    }


def _ns_identity(node: NodeLayout) -> tuple[int, int, int] | None:
    """The inode numbers of the node's three namespaces: new ones after a
    reboot, so helpers of the old namespaces are never used."""
    try:
        return (
            os.stat(node.netns_path).st_ino,
            os.stat(node.mnt_file).st_ino,
            os.stat(node.uts_file).st_ino,
        )
    except OSError:
        return None


class _Helper:
    """One serving ``_nodeops.py --serve`` process inside a node."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, node: NodeLayout) -> _Helper:
        argv = [sys.executable, "-I", "-S", str(NODEOPS), "--serve"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,  # a helper's crash shows in the server's log
                start_new_session=True,  # not killed by a Ctrl-C meant for the server
            )
        except OSError as exc:
            raise CommandError(argv, 127, b"", f"cannot start: {exc}") from exc
        helper = cls(proc)
        try:
            reply = await asyncio.wait_for(helper._exchange(_ns_request(node)), 30.0)
        except BaseException:
            await helper.close()
            raise
        if reply["rc"] != 0:
            await helper.close()
            raise CommandError(argv, reply["rc"], reply["err"])
        return helper

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        body = marshal.dumps(message)
        try:
            self.proc.stdin.write(len(body).to_bytes(4, "big") + body)
            await self.proc.stdin.drain()
            head = await self.proc.stdout.readexactly(4)
            reply: dict[str, Any] = marshal.loads(
                await self.proc.stdout.readexactly(int.from_bytes(head, "big"))
            )
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise _HelperDied(str(exc)) from exc
        return reply

    async def request(self, op: str, args: dict[str, Any]) -> Completed:
        reply = await self._exchange({"op": op, "args": args})
        return Completed((op,), reply["rc"], reply["out"], reply["err"])

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await asyncio.shield(self.proc.wait())

    async def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # EOF: it exits
        if self.alive:
            try:
                await asyncio.wait_for(self.proc.wait(), 2.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


class _Helpers:
    """The kept helpers of one node's current namespaces, on one event loop."""

    def __init__(self, node: NodeLayout, identity: tuple[int, int, int]) -> None:
        self._node = node
        self.identity = identity
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Helper] = []

    async def call(self, op: str, args: dict[str, Any], *, timeout_s: float) -> Completed:
        for attempt in (1, 2):
            helper = (self._take() if attempt == 1 else None) or await _Helper.start(self._node)
            try:
                done = await asyncio.wait_for(helper.request(op, args), timeout_s)
            except _HelperDied:
                await helper.close()
                if attempt == 2:
                    raise CommandError((op,), 1, b"", "the node's helper died") from None
                # Killed with the node's processes (its idle siblings too,
                # most likely), or crashed: drop them all and try once more
                # with a fresh one; every op is idempotent.
                self.drop_idle()
                continue
            except TimeoutError:
                await helper.kill()
                raise CommandTimeoutError(
                    (op,), -9, b"", f"timed out after {timeout_s:g}s"
                ) from None
            except BaseException:
                # Cancelled mid-request: its reply would answer the next
                # request, so this helper is done.
                await helper.kill()
                raise
            if len(self.idle) < MAX_IDLE_HELPERS:
                self.idle.append(helper)
            else:
                await helper.close()
            return done
        raise AssertionError("unreachable")

    def drop_idle(self) -> None:
        idle, self.idle = self.idle, []
        for helper in idle:
            with contextlib.suppress(ProcessLookupError):
                helper.proc.kill()

    def _take(self) -> _Helper | None:
        while self.idle:
            helper = self.idle.pop()
            if helper.alive:
                return helper
        return None

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for helper in idle:
            await helper.close()


_HELPERS: dict[str, _Helpers] = {}


def _helpers_for(node: NodeLayout) -> _Helpers:
    """The node's kept helpers; raises _NoHelper if it is not (fully) up."""
    identity = _ns_identity(node)
    if identity is None:
        raise _NoHelper
    key = str(node.mnt_file)
    helpers = _HELPERS.get(key)
    loop = asyncio.get_running_loop()
    if helpers is None or helpers.identity != identity or helpers.loop is not loop:
        if helpers is not None:
            # Helpers of namespaces that are gone were killed with them; of
            # another event loop, they cannot be awaited here: drop them.
            helpers.drop_idle()
        helpers = _Helpers(node, identity)
        _HELPERS[key] = helpers
        _forget_gone(loop)
    return helpers


def _forget_gone(loop: asyncio.AbstractEventLoop) -> None:
    """Drop the entries of nodes that are gone or were rebooted since (their
    helpers died with them), so a long-lived server's table does not grow
    with every node it ever made. Runs when an entry is made: once per node
    boot."""
    for key, helpers in list(_HELPERS.items()):
        if helpers.loop is not loop or _ns_identity(helpers._node) != helpers.identity:
            helpers.drop_idle()
            del _HELPERS[key]


async def close_helpers() -> None:
    """Stop every kept helper (server shutdown)."""
    pools = list(_HELPERS.values())
    _HELPERS.clear()
    loop = asyncio.get_running_loop()
    for pool in pools:
        if pool.loop is loop:
            await pool.close()


def as_node_shell(shell: NamespaceShell) -> NodeShell:
    """Typed factory; also where mypy checks NamespaceShell against the
    NodeShell protocol."""
    return shell
