"""A node's cgroups (linux/procs: make_cgroup, cgroup_pids, kill_cgroup,
remove_cgroup) against a fake cgroup root in a temp directory.

The fake is a plain directory tree shaped like a v1 hybrid mount
(``cpuset``, ``memory`` and the v2 ``unified``, each with a ``cgroup.procs``).
Unlike a real cgroupfs, the kernel does not create knob files in a new
directory nor empty ``cgroup.procs`` when a process exits, so the tests
create those themselves where the behaviour depends on them."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuclusters.linux.procs import (
    ProcessesSurviveError,
    cgroup_pids,
    kill_cgroup,
    make_cgroup,
    remove_cgroup,
)

NAME = "gpc-test"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    for hierarchy in ("cpuset", "memory", "unified"):
        (root / hierarchy).mkdir(parents=True)
        (root / hierarchy / "cgroup.procs").write_text("")
    (root / "cpuset" / "cpuset.cpus").write_text("0-15\n")
    (root / "cpuset" / "cpuset.mems").write_text("0-1\n")
    return root


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)


# --- make_cgroup ------------------------------------------------------------------------------


def test_make_cgroup_creates_under_every_v1_controller(root: Path) -> None:
    make_cgroup(NAME, root=root)
    assert (root / "cpuset" / NAME).is_dir()
    assert (root / "memory" / NAME).is_dir()
    assert not (root / "unified" / NAME).exists()


def test_make_cgroup_copies_parent_cpuset_into_empty_knobs(root: Path) -> None:
    # On a real cgroupfs the kernel creates these, empty, with the directory.
    mine = root / "cpuset" / NAME
    mine.mkdir()
    (mine / "cpuset.cpus").write_text("\n")
    (mine / "cpuset.mems").write_text("")
    make_cgroup(NAME, root=root)
    assert (mine / "cpuset.cpus").read_text() == "0-15\n"
    assert (mine / "cpuset.mems").read_text() == "0-1\n"


def test_make_cgroup_keeps_cpuset_values_already_set(root: Path) -> None:
    mine = root / "cpuset" / NAME
    mine.mkdir()
    (mine / "cpuset.cpus").write_text("2-3\n")
    (mine / "cpuset.mems").write_text("")
    make_cgroup(NAME, root=root)
    assert (mine / "cpuset.cpus").read_text() == "2-3\n"
    assert (mine / "cpuset.mems").read_text() == "0-1\n"


def test_make_cgroup_creates_no_knob_files_of_its_own(root: Path) -> None:
    # Knobs are the kernel's: where none exist, none are invented (and the
    # memory controller, which has no cpuset knobs, is not given any).
    make_cgroup(NAME, root=root)
    assert list((root / "cpuset" / NAME).iterdir()) == []
    assert list((root / "memory" / NAME).iterdir()) == []


def test_make_cgroup_is_idempotent(root: Path) -> None:
    make_cgroup(NAME, root=root)
    (root / "memory" / NAME / "child").mkdir()
    make_cgroup(NAME, root=root)
    assert (root / "memory" / NAME / "child").is_dir()


def test_make_cgroup_skips_non_hierarchies(root: Path) -> None:
    (root / "misc").mkdir()  # a directory without cgroup.procs
    (root / "notes").write_text("a file")
    # Like /sys/fs/cgroup/cpu -> cpu,cpuacct.
    (root / "cpu,cpuacct").mkdir()
    (root / "cpu,cpuacct" / "cgroup.procs").write_text("")
    (root / "cpu").symlink_to("cpu,cpuacct")
    make_cgroup(NAME, root=root)
    assert not (root / "misc" / NAME).exists()
    assert (root / "cpu,cpuacct" / NAME).is_dir()


def test_make_cgroup_without_a_cgroup_root_does_nothing(tmp_path: Path) -> None:
    make_cgroup(NAME, root=tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


# --- cgroup_pids ------------------------------------------------------------------------------


def _procs(path: Path, *pids: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))


def test_cgroup_pids_reads_nested_groups_in_every_hierarchy(root: Path) -> None:
    _procs(root / "memory" / NAME, 101)
    _procs(root / "memory" / NAME / "kubepods" / "pod1", 102, 103)
    _procs(root / "cpuset" / NAME, 101, 104)
    _procs(root / "unified" / NAME / "x", 105)
    # Other cgroups, and the hierarchy's own top, are not the node's.
    _procs(root / "memory" / "gpc-other", 900)
    (root / "memory" / "cgroup.procs").write_text("1\n")
    assert cgroup_pids(NAME, root=root) == {101, 102, 103, 104, 105}


def test_cgroup_pids_never_includes_the_caller(root: Path) -> None:
    _procs(root / "memory" / NAME, os.getpid(), 4242)
    assert cgroup_pids(NAME, root=root) == {4242}


def test_cgroup_pids_of_a_missing_group_is_empty(root: Path, tmp_path: Path) -> None:
    assert cgroup_pids(NAME, root=root) == set()
    assert cgroup_pids(NAME, root=tmp_path / "absent") == set()
    # A directory without a cgroup.procs file is skipped, not an error.
    (root / "memory" / NAME).mkdir()
    assert cgroup_pids(NAME, root=root) == set()


# --- kill_cgroup ------------------------------------------------------------------------------


def _empty_when_dead(proc: subprocess.Popen[bytes], procs_file: Path) -> threading.Thread:
    """Play the kernel: once the process has exited (and is reaped), it
    leaves the cgroup."""

    def run() -> None:
        proc.wait(timeout=10)
        procs_file.write_text("")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_kill_cgroup_sigkills_every_member(root: Path, sleeper: subprocess.Popen[bytes]) -> None:
    group = root / "memory" / NAME / "kubepods" / "pod1"
    _procs(group, sleeper.pid)
    watcher = _empty_when_dead(sleeper, group / "cgroup.procs")
    assert kill_cgroup(NAME, timeout_s=5, root=root) == 1
    watcher.join(timeout=5)
    assert sleeper.returncode == -9  # SIGKILL
    assert cgroup_pids(NAME, root=root) == set()


def test_kill_cgroup_raises_if_processes_stay_listed(
    root: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    # Nothing empties the file: to kill_cgroup the process never leaves.
    _procs(root / "cpuset" / NAME, sleeper.pid)
    with pytest.raises(ProcessesSurviveError, match=str(sleeper.pid)):
        kill_cgroup(NAME, timeout_s=0.1, root=root)
    # It was signalled all the same.
    assert sleeper.wait(timeout=5) == -9


def test_kill_cgroup_with_no_members_returns_zero(root: Path) -> None:
    make_cgroup(NAME, root=root)
    assert kill_cgroup(NAME, timeout_s=0.1, root=root) == 0
    assert kill_cgroup("gpc-absent", timeout_s=0.1, root=root) == 0


# --- remove_cgroup ----------------------------------------------------------------------------


def test_remove_cgroup_removes_nested_groups_deepest_first(tmp_path: Path) -> None:
    # To rmdir, a real cgroup tree is a tree of empty directories (its files
    # are the kernel's); rmdir of a parent before its children would fail.
    root = tmp_path / "cgroup"
    for d in (
        "cpuset/gpc-test/kubepods/burstable/pod1",
        "cpuset/gpc-test/kubepods/besteffort",
        "memory/gpc-test/kubepods/burstable/pod1/ctr",
        "memory/gpc-other/x",
    ):
        (root / d).mkdir(parents=True)
    remove_cgroup(NAME, timeout_s=1, root=root)
    assert not (root / "cpuset" / NAME).exists()
    assert not (root / "memory" / NAME).exists()
    assert (root / "cpuset").is_dir()
    assert (root / "memory" / "gpc-other" / "x").is_dir()


def test_remove_cgroup_of_a_missing_group_is_a_no_op(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    remove_cgroup(NAME, timeout_s=0.1, root=root)
    remove_cgroup(NAME, timeout_s=0.1, root=tmp_path / "absent")
    assert (root / "memory").is_dir()


def test_remove_cgroup_gives_up_after_the_timeout(tmp_path: Path) -> None:
    # Stands in for a cgroup that stays busy (EBUSY on a real cgroupfs).
    root = tmp_path / "cgroup"
    busy = root / "memory" / NAME
    busy.mkdir(parents=True)
    (busy / "leftover").write_text("")
    with pytest.raises(OSError):
        remove_cgroup(NAME, timeout_s=0.05, root=root)
    assert busy.is_dir()
