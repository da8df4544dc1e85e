"""A test-only ``NodeShell`` over the prototype's namespaces (``scripts/setup-slurm-proto
nodes``): nsenter into a network + mount + UTS namespace. Daemons are tracked by pid
files on the host under /tmp/<node>/pids; the real netns provider replaces all this."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuclusters.core.nodeshell import CommandResult, NodeCommandError

NSDIR = "/tmp/gpct-ns"
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


class NsenterShell:
    def __init__(self, name: str, address: str) -> None:
        self._name = name
        self._address = address
        self._pids = Path(f"/tmp/{name}/pids")
        self._pids.mkdir(parents=True, exist_ok=True)

    @property
    def hostname(self) -> str:
        return self._name

    @property
    def address(self) -> str:
        return self._address

    @property
    def python(self) -> str:
        return sys.executable

    def _prefix(self) -> list[str]:
        n = self._name
        return [
            "nsenter",
            f"--net=/run/netns/{n}",
            f"--mount={NSDIR}/{n}.mnt",
            f"--uts={NSDIR}/{n}.uts",
            "--",
        ]

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"] if user else []
        return [*self._prefix(), *as_user, *argv]

    async def _raw(
        self,
        argv: Sequence[str],
        *,
        user: str | None,
        env: Mapping[str, str] | None,
        stdin: bytes | None,
        timeout_s: float,
    ) -> tuple[int, bytes, bytes]:
        full_env = dict(BASE_ENV)
        if user:
            full_env.update({"USER": user, "HOME": f"/home/{user}"})
        full_env.update(env or {})
        proc = await asyncio.create_subprocess_exec(
            *self.exec_argv(argv, user=user),
            env=full_env,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, b"", b"timeout"
        return proc.returncode or 0, out, err

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
        rc, out, err = await self._raw(argv, user=user, env=env, stdin=stdin, timeout_s=timeout_s)
        result = CommandResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and rc != 0:
            raise NodeCommandError(self._name, argv, result)
        return result

    def _pid(self, name: str) -> int | None:
        try:
            pid = int((self._pids / f"{name}.pid").read_text())
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return None if state in ("Z", "X") else pid

    async def is_running(self, name: str) -> bool:
        return self._pid(name) is not None

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        if self._pid(name) is not None:
            return
        await self.run(["mkdir", "-p", "/var/log/gpuclusters"])
        script = 'exec "$@" >>/var/log/gpuclusters/"$0".log 2>&1 </dev/null'
        proc = await asyncio.create_subprocess_exec(
            *self.exec_argv(["sh", "-c", script, name, *argv]),
            env={**BASE_ENV, **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        (self._pids / f"{name}.pid").write_text(str(proc.pid))

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._pid(name) is not None and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self._pid(name) is not None:
            os.kill(pid, signal.SIGKILL)
            while self._pid(name) is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    async def read_file(self, path: str) -> bytes | None:
        rc, out, _ = await self._raw(["cat", path], user=None, env=None, stdin=None, timeout_s=10)
        return out if rc == 0 else None

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        current = await self.read_file(path)
        if current == data:
            r = await self.run(["stat", "-c", "%a %U", path])
            if r.stdout.split() == [f"{mode:o}", owner or "root"]:
                return False
        script = (
            'set -e; mkdir -p "$(dirname "$1")"; cat > "$1.gpc-tmp"; chmod "$2" "$1.gpc-tmp";'
            ' chown "$3:" "$1.gpc-tmp"; mv -f "$1.gpc-tmp" "$1"'
        )
        await self.run(["sh", "-c", script, "sh", path, f"{mode:o}", owner or "root"], stdin=data)
        return True
