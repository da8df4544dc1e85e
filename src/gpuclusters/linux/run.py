"""The one way this package runs programs: argv lists, never shell strings.

Every subprocess the embedded fleet starts (``ip``, ``unshare``, ``nsenter``,
the helper scripts) goes through :func:`run`, so that all of them

* take an argv list (user input can never be parsed by a shell),
* capture stdout and stderr (bytes; callers decode when they mean text),
* run in their own session, so a timeout or a cancelled caller kills the
  whole process group (``runuser`` and friends fork children that would
  otherwise outlive the parent),
* raise a typed error naming the command and quoting its stderr.

Errors::

    CommandError             non-zero exit (with ``check=True``), or cannot start
    └── CommandTimeoutError  still running after ``timeout_s``; killed
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


class CommandError(Exception):
    """A command failed; the message names it and quotes its stderr."""

    def __init__(
        self, argv: Sequence[str], returncode: int, stderr: bytes, detail: str = ""
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.decode("utf-8", "replace")
        tail = self.stderr.strip()[-800:]
        what = detail or f"exited {returncode}"
        super().__init__(f"{shlex.join(self.argv)[:300]}: {what}" + (f": {tail}" if tail else ""))


class CommandTimeoutError(CommandError):
    """The command ran past its timeout and was killed."""


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # The child leads its own session (start_new_session), so its pid is the
    # process group id; killing the group also reaps grandchildren.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run(
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    check: bool = True,
) -> Completed:
    """Run ``argv`` and wait for it; see the module docstring for the rules."""
    args = tuple(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except OSError as exc:
        raise CommandError(args, 127, b"", f"cannot start: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except TimeoutError:
        _kill_group(proc)
        await proc.wait()
        raise CommandTimeoutError(args, -9, b"", f"timed out after {timeout_s:g}s") from None
    except BaseException:
        # Cancelled (server shutting down, caller gave up): do not leave the
        # command running behind our back.
        _kill_group(proc)
        with contextlib.suppress(BaseException):
            await asyncio.shield(proc.wait())
        raise
    assert proc.returncode is not None
    done = Completed(args, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise CommandError(args, done.returncode, err)
    return done
