"""``NamespaceShell``: the ``core.nodeshell.NodeShell`` of a namespace node.

* ``run`` is ``nsenter --net --mount --uts -- [runuser -u USER --] argv``,
  with a clean environment (PATH, HOME, LANG plus the caller's ``env``):
  nothing of the server's environment (database URL, keys) reaches a node.
  nsenter's setns of the mount namespace also sets the root and working
  directory to the node's ``/``.
* files and daemons go through the :mod:`._nodeops` helper, which joins the
  node's namespaces itself and so works whatever is installed in the node.
* ``exec_argv`` is the same nsenter line, for a terminal.

Timeouts of ``run`` come back as exit status 124, like timeout(1) (the
command's whole process group is killed). ``run`` waits until every process
holding its output exits, so a command that backgrounds a daemon (``cmd &``)
runs into the timeout: long-lived processes belong to ``spawn``.
"""

from __future__ import annotations

import marshal
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuclusters.core.nodeshell import CommandResult, NodeCommandError, NodeShell
from gpuclusters.linux.layout import NODE_ENV, NodeLayout
from gpuclusters.linux.run import CommandError, CommandTimeoutError, Completed, run

NODEOPS = Path(__file__).with_name("_nodeops.py")
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

    def _nsenter(self) -> list[str]:
        return ["nsenter", *self._node.nsenter_args(), "--"]

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
        request = {
            "netns": str(node.netns_path),
            "mnt": str(node.mnt_file),
            "uts": str(node.uts_file),
            "op": op,
            "args": args,
        }
        argv = [sys.executable, "-I", "-S", str(NODEOPS)]
        what = [op, *(str(v) for k, v in args.items() if k != "data")]
        try:
            done = await run(argv, stdin=marshal.dumps(request), timeout_s=timeout_s, check=False)
        except CommandError as exc:
            raise NodeCommandError(
                self._hostname, what, CommandResult(exc.returncode, "", str(exc))
            ) from exc
        if done.returncode not in ok:
            result = CommandResult(done.returncode, _text(done.stdout), _text(done.stderr))
            raise NodeCommandError(self._hostname, what, result)
        return done

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


def as_node_shell(shell: NamespaceShell) -> NodeShell:
    """Typed factory; also where mypy checks NamespaceShell against the
    NodeShell protocol."""
    return shell
