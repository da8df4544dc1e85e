"""gpuclusters.builds.runner: runs a plan of real processes, one per slot,
keeps the status file current, and skips what a failure blocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuclusters.builds import status as status_file
from gpuclusters.builds.runner import Runner
from gpuclusters.core.builds import Slot, Step, StepState
from gpuclusters.linux.procs import process_running

GPUCLUSTERS = str(Path(sys.executable).with_name("gpuclusters"))


def _script(root: Path, name: str, body: str) -> None:
    path = root / "scripts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    # Each step records when it ran; `fail` exits 3 after a line of output.
    _script(root, "step", 'date +%s.%N > "$0.$1.start"; sleep 0.3; date +%s.%N > "$0.$1.end"')
    _script(root, "fail", "echo 'ERROR: no such module' >&2; exit 3")
    return root


def _times(root: Path, name: str) -> tuple[float, float]:
    base = root / "scripts" / f"step.{name}"
    start = float(Path(f"{base}.start").read_text())
    end = float(Path(f"{base}.end").read_text())
    return start, end


def test_a_cpu_and_an_io_step_run_side_by_side_and_order_is_kept(
    root: Path, tmp_path: Path
) -> None:
    plan = [
        Step("a", ("scripts/step", "a"), Slot.CPU),
        Step("b", ("scripts/step", "b"), Slot.CPU),
        Step("c", ("scripts/step", "c"), Slot.IO),
        Step("d", ("scripts/step", "d"), Slot.IO, after=("b",)),
    ]
    runner = Runner(plan, root, tmp_path / "builds")
    assert runner.run() == 0

    a, b, c, d = (_times(root, n) for n in "abcd")
    assert a[0] < c[1] and c[0] < a[1]  # a and c overlapped
    assert b[0] >= a[1]  # one cpu step at a time
    assert d[0] >= b[1]  # after its predecessor
    observed = status_file.read(tmp_path / "builds")
    assert observed is not None and not observed.alive
    assert all(s.state is StepState.DONE for s in observed.status.steps)
    assert observed.status.finished_at is not None


def test_a_failure_is_recorded_with_its_last_line_and_blocks_what_follows(
    root: Path, tmp_path: Path
) -> None:
    plan = [
        Step("broken", ("scripts/fail",), Slot.CPU),
        Step("after-broken", ("scripts/step", "x"), Slot.IO, after=("broken",)),
        Step("independent", ("scripts/step", "y"), Slot.IO),
    ]
    runner = Runner(plan, root, tmp_path / "builds")
    assert runner.run() == 1

    doc = json.loads((tmp_path / "builds" / "status.json").read_text())
    states = {s["name"]: (s["state"], s["error"]) for s in doc["steps"]}
    assert states["broken"] == ("failed", "ERROR: no such module")
    assert states["after-broken"] == ("skipped", "a step it needs failed")
    assert states["independent"][0] == "done"
    assert not (root / "scripts" / "step.x.start").exists()
    log = Path(next(s["log"] for s in doc["steps"] if s["name"] == "broken"))
    assert log.read_text() == "ERROR: no such module\n"


def test_sigterm_ends_running_steps_and_records_them_as_interrupted(
    root: Path, tmp_path: Path
) -> None:
    _script(root, "slow", "exec sleep 60")
    runner = Runner([Step("slow", ("scripts/slow",), Slot.CPU)], root, tmp_path / "builds")
    procs: list[subprocess.Popen[bytes]] = []
    before = signal.getsignal(signal.SIGTERM)

    def terminate_once_running() -> None:
        deadline = time.monotonic() + 10
        while "slow" not in runner.running and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.append(runner.running["slow"][0])
        os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, in run()

    killer = threading.Thread(target=terminate_once_running, daemon=True)
    killer.start()
    assert runner.run_until_signalled() == 130
    killer.join()

    assert procs and procs[0].poll() is not None  # the step's process is gone
    step = runner.status.step("slow")
    assert (step.state, step.error) == (StepState.FAILED, "interrupted")
    observed = status_file.read(tmp_path / "builds")
    assert observed is not None and not observed.alive
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_detach_returns_once_the_status_names_the_builder_and_a_second_changes_nothing(
    tmp_path: Path,
) -> None:
    """The real plan on this machine's caches (scripts/setup built them, so
    every step is a stamp check): --detach, a second --detach while the
    first runs, then `gpuclusters builds --wait`."""
    env = {**os.environ, status_file.DIR_ENV: str(tmp_path / "builds")}
    cmd = [sys.executable, "-m", "gpuclusters.builds.runner"]
    first = subprocess.run([*cmd, "--detach"], env=env, capture_output=True, text=True, check=True)
    observed = status_file.read(tmp_path / "builds")
    assert observed is not None, first.stdout
    pid = observed.status.runner_pid
    assert f"pid {pid}" in first.stdout and pid != os.getpid()

    second = subprocess.run([*cmd, "--detach"], env=env, capture_output=True, text=True, check=True)
    if process_running(pid):
        assert "background builds" in second.stdout, second.stdout
        again = status_file.read(tmp_path / "builds")
        assert again is not None and again.status.runner_pid == pid

    waited = subprocess.run(
        [GPUCLUSTERS, "builds", "--wait", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert waited.returncode == 0, waited.stdout + waited.stderr
    doc = json.loads(waited.stdout)
    assert doc["runner_pid"] == pid and doc["alive"] is False
    assert {s["state"] for s in doc["steps"]} == {"done"}, doc
