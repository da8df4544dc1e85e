"""The background builder: runs core/builds.py's plan, one ``cpu`` and one
``io`` step at a time, keeping ``status.json`` current.

    python -m gpuclusters.builds.runner --detach   start it in the background
                                                   (scripts/setup); returns once
                                                   its status file names it
    python -m gpuclusters.builds.runner --wait     build in the foreground, with
                                                   progress (scripts/setup
                                                   --for-tests); exit 1 if a
                                                   step failed

Progress and each step's state: ``gpuclusters builds`` (cli/builds.py).

One builder at a time per builds directory (``runner.lock``, ``flock``).
``--detach`` while one runs changes nothing; ``--wait`` while one runs
waits for it, then runs the plan itself (every step is a stamp check by
then), so it ends with everything built or says what failed.

Steps run as their own process groups, their output in ``logs/<step>.log``;
SIGINT or SIGTERM stops them and records them as failed ("interrupted"),
so a later run builds them again (the build scripts restart a half-made
output from scratch).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from gpuclusters.builds import status as status_file
from gpuclusters.core.builds import (
    BACKGROUND_PLAN,
    BuildStatus,
    Step,
    StepState,
    blocked,
    check_plan,
    runnable,
    summary,
)

POLL_S = 0.5
ANNOUNCE_AFTER_S = 2.0
DETACH_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[3]  # the checkout (src/gpuclusters/builds/..)


def say(message: str) -> None:
    print(f"build: {message}", flush=True)


class Interrupted(Exception):
    pass


class Runner:
    def __init__(self, plan: Sequence[Step], root: Path, directory: Path) -> None:
        check_plan(plan)
        self.plan = list(plan)
        self.root = root
        self.dir = directory
        self.logs = directory / "logs"
        self.status = BuildStatus.fresh(
            plan, pid=os.getpid(), now=time.time(), log_dir=str(self.logs)
        )
        self.running: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        self.announced: set[str] = set()

    def _save(self) -> None:
        status_file.write(self.status, self.dir)

    def _start(self, step: Step) -> None:
        entry = self.status.step(step.name)
        log = open(entry.log, "wb")  # noqa: SIM115 (closed when the step ends)
        proc = subprocess.Popen(
            [str(self.root / step.argv[0]), *step.argv[1:]],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # stopped as a group
        )
        self.running[step.name] = (proc, log)
        entry.state = StepState.BUILDING
        entry.started_at = time.time()

    def _announce(self) -> None:
        """Say which steps build, once each has run ANNOUNCE_AFTER_S: a step
        whose output is current ends sooner (a stamp check) and is reported
        in one line when it ends."""
        now = time.time()
        for name in self.running:
            entry = self.status.step(name)
            started = entry.started_at or now
            if name not in self.announced and now - started >= ANNOUNCE_AFTER_S:
                self.announced.add(name)
                say(f"{name}: building (log {entry.log})")

    def _finish(self, name: str, rc: int) -> None:
        _, log = self.running.pop(name)
        log.close()
        entry = self.status.step(name)
        entry.finished_at = time.time()
        seconds = entry.finished_at - (entry.started_at or entry.finished_at)
        if rc == 0:
            entry.state = StepState.DONE
            if name in self.announced:
                say(f"{name}: done in {seconds:.0f} s")
            else:
                say(f"{name}: up to date")
        else:
            entry.state = StepState.FAILED
            entry.error = _last_line(Path(entry.log)) or f"exit code {rc}"
            say(f"{name}: FAILED after {seconds:.0f} s: {entry.error} (log {entry.log})")

    def _skip_blocked(self) -> None:
        for name in blocked(self.plan, self.status.states()):
            entry = self.status.step(name)
            entry.state = StepState.SKIPPED
            entry.error = "a step it needs failed"
            say(f"{name}: skipped (a step it needs failed)")

    def stop(self) -> None:
        for name, (proc, _) in list(self.running.items()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self._finish(name, -1)
            self.status.step(name).error = "interrupted"
        self.status.finished_at = time.time()
        self._save()

    def run(self) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._save()
        say(f"{len(self.plan)} steps; status in {status_file.status_path(self.dir)}")
        while True:
            busy = {s.slot for s in self.plan if s.name in self.running}
            started = runnable(self.plan, self.status.states(), busy)
            for step in started:
                self._start(step)
            if started:
                self._save()
            if not self.running:
                break
            time.sleep(POLL_S)
            self._announce()
            changed = False
            for name, (proc, _) in list(self.running.items()):
                rc = proc.poll()
                if rc is not None:
                    self._finish(name, rc)
                    changed = True
            if changed:
                self._skip_blocked()
                self._save()
        self._skip_blocked()
        self.status.finished_at = time.time()
        self._save()
        failed = self.status.failed()
        say(summary(self.status, alive=False, now=time.time()))
        return 1 if failed else 0

    def run_until_signalled(self) -> int:
        """``run``; SIGINT or SIGTERM (main thread) stops the running steps
        and records them as interrupted (exit code 130)."""

        def interrupted(signum: int, frame: FrameType | None) -> None:
            raise Interrupted(signal.Signals(signum).name)

        previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self.run()
        except Interrupted as exc:
            say(f"{exc}: stopping")
            self.stop()
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def _lock(directory: Path, *, wait: bool) -> int | None:
    """The builder lock's file descriptor, or None when another builder
    holds it and ``wait`` is False."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "runner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        if not wait:
            os.close(fd)
            return None
    observed = status_file.read(directory)
    pid = observed.status.runner_pid if observed else "?"
    say(f"another builder (pid {pid}) is running: waiting for it")
    last = ""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            observed = status_file.read(directory)
            if observed is not None:
                line = summary(observed.status, alive=observed.alive, now=time.time())
                if line != last:
                    say(line)
                    last = line
            time.sleep(5)


def _run_locked(fd: int, directory: Path, root: Path) -> int:
    try:
        return Runner(BACKGROUND_PLAN, root, directory).run_until_signalled()
    finally:
        os.close(fd)


def _detach(directory: Path, root: Path) -> int:
    fd = _lock(directory, wait=False)
    if fd is None:
        observed = status_file.read(directory)
        if observed is not None:
            say(summary(observed.status, alive=observed.alive, now=time.time()))
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "runner.log", "ab") as log:
        # The child inherits the locked file description: the lock stays
        # held after this process exits.
        child = subprocess.Popen(
            [sys.executable, "-m", "gpuclusters.builds.runner", "--run-locked", str(fd)],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(fd,),
            start_new_session=True,
            env={**os.environ, status_file.DIR_ENV: str(directory)},
        )
    os.close(fd)
    # Return once the status file names the child: a server started next
    # sees what is still being built (a cluster waits for it).
    deadline = time.monotonic() + DETACH_TIMEOUT_S
    while time.monotonic() < deadline:
        observed = status_file.read(directory)
        if observed is not None and observed.status.runner_pid == child.pid:
            say(
                f"building {len(observed.status.steps)} add-ons and images in the background "
                f"(pid {child.pid}; progress: gpuclusters up, log {directory / 'runner.log'})"
            )
            return 0
        if child.poll() is not None:
            say(
                f"the background builder exited at once (code {child.returncode}): see "
                f"{directory / 'runner.log'}"
            )
            return 1
        time.sleep(0.05)
    say(f"the background builder (pid {child.pid}) wrote no status in {DETACH_TIMEOUT_S:.0f} s")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuclusters.builds.runner")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--detach", action="store_true", help="build in the background")
    mode.add_argument("--wait", action="store_true", help="build in the foreground")
    mode.add_argument("--run-locked", type=int, metavar="FD", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    directory = status_file.builds_dir()
    if args.run_locked is not None:
        return _run_locked(args.run_locked, directory, ROOT)
    if args.detach:
        return _detach(directory, ROOT)
    fd = _lock(directory, wait=True)
    assert fd is not None
    return _run_locked(fd, directory, ROOT)


if __name__ == "__main__":
    sys.exit(main())
