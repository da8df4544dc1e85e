"""A third-party daemon the server runs and keeps: the image registry
(``registry_daemon``) and the metrics database (``metrics_db``).

The server writes the daemon's configuration file, starts it in a session
of its own (its pid in a pid file next to the configuration) and stops it
at shutdown. A server killed without a shutdown leaves it running; the
next start finds it by its pid file and command line and keeps it when its
command line and configuration are unchanged, else replaces it, so there
is never more than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.linux.procs import cmdline, process_running


class KeptProcessError(RuntimeError):
    pass


class KeptProcess:
    """``argv`` run with its output in ``directory/<name>.log``; ``ready``
    answers whether it serves (polled after a start, up to
    ``start_timeout_s``)."""

    def __init__(
        self,
        name: str,
        directory: Path,
        argv: list[str],
        *,
        config_file: Path,
        ready: Callable[[], Awaitable[bool]],
        start_timeout_s: float = 20.0,
    ) -> None:
        self.name = name
        self.dir = directory
        self.argv = argv
        self.config_file = config_file
        self.pid_file = directory / f"{name}.pid"
        self.log_file = directory / f"{name}.log"
        self.ready = ready
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def running_pid(self) -> int | None:
        """The daemon's pid, if the pid file names a live process with this
        command line."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if process_running(pid) and cmdline(pid) == self.argv:
            return pid
        return None

    async def start(self, config: str) -> bool:
        """Run the daemon with ``config`` (idempotent); whether it was
        (re)started rather than found running as configured."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        changed = not self.config_file.exists() or self.config_file.read_text() != config
        if changed:
            replace_atomically(self.config_file, config.encode(), mode=0o600)
        pid = self.running_pid()
        if pid is not None and not changed:
            await self._wait_ready()
            return False
        if pid is None:
            # A stale daemon of ours under another command line (flags changed
            # since it started): the pid file still names it.
            pid = self._stale_pid()
        if pid is not None:
            await self._terminate(pid)
        proc = await asyncio.to_thread(self._spawn)
        replace_atomically(self.pid_file, f"{proc.pid}\n".encode(), mode=0o644)
        self._proc = proc
        await self._wait_ready()
        return True

    def _stale_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        argv = cmdline(pid)
        if process_running(pid) and argv[:1] == self.argv[:1]:
            return pid
        return None

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log_file.open("ab") as log_file:
            # subprocess, not the event loop's: uvloop's spawn leaves the
            # server's inheritable listening sockets open in the child, which
            # would then hold the API's ports after a kill -9 of the server.
            return subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                close_fds=True,
                # Its own session: a Ctrl-C to the server's terminal does not
                # reach it; the server stops it itself at shutdown.
                start_new_session=True,
            )

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if await self.ready():
                return
            if self._proc is not None and self._proc.poll() is not None:
                raise KeptProcessError(f"{self.name} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise KeptProcessError(f"{self.name} did not start; its log:\n{self.log_tail()}")
            await asyncio.sleep(0.1)

    def log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    async def _terminate(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        proc = self._proc
        if proc is not None and proc.pid == pid:
            # Our own child: reaped here (else it would stay a zombie).
            try:
                await asyncio.to_thread(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            return
        for _ in range(100):
            if not process_running(pid):
                return
            await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def stop(self) -> bool:
        """Stop the daemon; whether one was running."""
        pid = self.running_pid()
        if pid is not None:
            await self._terminate(pid)
        self.pid_file.unlink(missing_ok=True)
        return pid is not None
