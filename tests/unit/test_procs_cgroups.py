"""A node's cgroups (linux/nodecgroup: make, its limits; linux/procs:
cgroup_pids, kill_cgroup, remove_cgroup) against a fake cgroup root in a
temp directory.

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

from gpuclusters.linux import nodecgroup
from gpuclusters.linux.procs import (
    ProcessesSurviveError,
    cgroup_pids,
    kill_cgroup,
    remove_cgroup,
)


def make_cgroup(name: str, root: Path) -> None:
    nodecgroup.make(name, nodecgroup.NodeLimits(), root=root)


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
    assert [p.name for p in (root / "cpuset" / NAME).iterdir()] == [nodecgroup.LEAF]
    assert list((root / "cpuset" / NAME / nodecgroup.LEAF).iterdir()) == []
    assert [p.name for p in (root / "memory" / NAME).iterdir()] == [nodecgroup.LEAF]


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


# --- limits -----------------------------------------------------------------------------------


def test_host_share_leaves_the_reserve() -> None:
    limits = nodecgroup.host_share(16, 64 * 1024**3, 4194304)
    assert limits.cpus == 15.75
    assert limits.memory_bytes == 64 * 1024**3 - int(64 * 1024**3 * 0.05)
    assert limits.pids == 4194304 - 4096
    small = nodecgroup.host_share(2, 4 * 1024**3, 32768, fraction=0.5)
    assert small.cpus == 0.88 and small.pids == (32768 - 4096) // 2
    assert small.memory_bytes == (4 * 1024**3 - 512 * 1024**2) // 2
    with pytest.raises(ValueError, match="share"):
        nodecgroup.host_share(2, 1, 1, fraction=0)


def test_make_sets_v1_limits_in_the_knobs_the_kernel_has(root: Path) -> None:
    for h in ("cpu", "pids"):
        (root / h).mkdir()
        (root / h / "cgroup.procs").write_text("")
    knobs = {
        "cpu": ("cpu.shares", "cpu.cfs_quota_us"),
        "memory": ("memory.limit_in_bytes",),
        "pids": ("pids.max",),
    }
    for h, names in knobs.items():
        (root / h / NAME).mkdir()
        for knob in names:
            (root / h / NAME / knob).write_text("")
    limits = nodecgroup.NodeLimits(cpus=1.5, memory_bytes=2**30, pids=5000)
    nodecgroup.make(NAME, limits, root=root)
    # A weight on v1, not a quota (v1 refuses a pod's quota above the node's).
    assert (root / "cpu" / NAME / "cpu.shares").read_text() == "1536"
    assert (root / "cpu" / NAME / "cpu.cfs_quota_us").read_text() == ""
    assert (root / "memory" / NAME / "memory.limit_in_bytes").read_text() == str(2**30)
    assert (root / "pids" / NAME / "pids.max").read_text() == "5000"
    assert not (root / "cpuset" / NAME / "pids.max").exists()
    assert nodecgroup.leaf_procs(NAME, root) == [
        str(root / h / NAME / "node" / "cgroup.procs") for h in ("cpu", "cpuset", "memory", "pids")
    ]


def test_make_on_v2_enables_controllers_and_sets_limits(tmp_path: Path) -> None:
    root = tmp_path / "cgroup2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    top = root / NAME
    top.mkdir()
    for knob in ("cgroup.subtree_control", "cpu.max", "memory.max", "pids.max"):
        (top / knob).write_text("")
    nodecgroup.make(NAME, nodecgroup.NodeLimits(cpus=0.5, memory_bytes=None, pids=100), root=root)
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (top / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (top / "cpu.max").read_text() == "50000 100000"
    assert (top / "memory.max").read_text() == "max"
    assert (top / "pids.max").read_text() == "100"
    assert (top / "node").is_dir()
    assert nodecgroup.leaf_procs(NAME, root) == [str(top / "node" / "cgroup.procs")]
