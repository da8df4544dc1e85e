"""Nodes in their own user namespaces (``GPUCLUSTERS_NODE_USERNS``): root in
a node is its project's first host id, and what only real root may do fails.

Each attack is tried as the node's root and, the same way, as root on the
host, where it must work (or fail only for want of something other than
privilege), so that a boundary that is absent makes the test fail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodetools import Fleet, host_pid, host_run, node_layout

from gpuclusters.core import idblocks
from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.linux import nodecgroup
from gpuclusters.providers.netns.provider import NetnsNodeProvider

# Each probe prints the errno name its system call ended with ("ok": none).
PROBE = """
import ctypes, errno, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def result(rc):
    print("ok" if rc == 0 else errno.errorcode[ctypes.get_errno()])
what = sys.argv[1]
if what == "mknod":  # the block device the root filesystem lives on
    dev = os.stat("/usr").st_dev
    result(libc.mknod(sys.argv[2].encode(), 0o600 | 0o060000, ctypes.c_ulong(dev)))
elif what == "module":  # init_module(2) of an empty image: privilege first
    result(libc.syscall(175, b"", ctypes.c_ulong(0), b""))
elif what == "sysctl":  # write back the value it has: a no-op if allowed
    path = "/proc/sys/kernel/panic"
    value = open(path).read()
    try:
        with open(path, "w") as f:
            f.write(value)
        print("ok")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
elif what == "hierarchy":  # a new cgroup v1 hierarchy (its release_agent is the escape)
    os.makedirs(sys.argv[2], exist_ok=True)
    rc = libc.mount(b"cgroup", sys.argv[2].encode(), b"cgroup", 0, b"none,name=gpcprobe")
    result(rc)
    if rc == 0:
        libc.umount2(sys.argv[2].encode(), 2)
"""


@dataclass
class UserNode:
    provider: NetnsNodeProvider
    shell: NodeShell
    node_id: str
    ids: IdBlock
    fleet: Fleet


@pytest.fixture
async def unode(fleet: Fleet) -> UserNode:
    p = fleet.provider(userns=True)
    ids = idblocks.block(5)
    spec = fleet.spec(fleet.cluster(), "u-node-1", "h100-a-01", host_ids=ids)
    await p.create(spec)
    return UserNode(p, await p.shell(spec.node_id), spec.node_id, ids, fleet)


async def _probe(shell: NodeShell, *args: str) -> str:
    r = await shell.run(["python3", "-c", PROBE, *args], check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _host_probe(*args: str) -> str:
    r = subprocess.run(["python3", "-c", PROBE, *args], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def _status_ids(pid: int) -> tuple[int, int]:
    lines = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(lines["Uid"].split()[1]), int(lines["Gid"].split()[1])


async def test_root_in_a_node_is_its_blocks_first_id_on_the_host(unode: UserNode) -> None:
    sh, ids = unode.shell, unode.ids
    assert (await sh.run(["id", "-u"])).stdout.strip() == "0"
    assert (await sh.run(["cat", "/proc/self/uid_map"])).stdout.split() == [
        "0",
        str(ids.first),
        "65536",
    ]
    # A process of the node, seen from the host.
    lay = node_layout(unode.fleet, unode.node_id)
    pid = await asyncio.to_thread(host_pid, lay, 1)  # the node's init
    assert pid is not None
    assert await asyncio.to_thread(_status_ids, pid) == (ids.first, ids.first)
    # Its files on the host's disk: shifted into the block.
    await sh.run(
        ["sh", "-c", "echo x > /tmp/by-root && touch /scratch/s && chown 10001 /tmp/by-root"]
    )
    node_dir = unode.fleet.home / "nodes" / unode.node_id
    assert (node_dir / "tmp" / "by-root").stat().st_uid == ids.first + 10001
    assert (node_dir / "scratch" / "s").stat().st_uid == ids.first
    # The host's own files, shared read-only, still look like root's.
    owners = await sh.run(["stat", "-c", "%u", "/usr/bin/passwd", "/etc/passwd", "/"])
    assert owners.stdout.split() == ["0", "0", "0"]
    # And an id beyond the block does not exist in the node.
    r = await sh.run(["chown", "70000", "/tmp/by-root"], check=False)
    assert r.returncode != 0 and "Invalid argument" in r.stderr


async def test_what_only_host_root_may_do_fails_in_a_node(unode: UserNode, tmp_path: Path) -> None:
    sh = unode.shell
    # Against the host itself each works, or fails past the privilege check.
    assert await asyncio.to_thread(_host_probe, "mknod", str(tmp_path / "disk")) == "ok"
    # (A kernel built without modules says ENOSYS to everyone: then there
    # is nothing to load, and the node is only checked to be no better.)
    host_module = await asyncio.to_thread(_host_probe, "module")
    assert host_module in ("EINVAL", "ENOEXEC", "EFAULT", "ENOSYS")
    assert await asyncio.to_thread(_host_probe, "sysctl") == "ok"
    assert await asyncio.to_thread(_host_probe, "hierarchy", str(tmp_path / "cg")) == "ok"
    # In the node, as its root.
    assert await _probe(sh, "mknod", "/tmp/disk") == "EPERM"
    assert await _probe(sh, "module") == ("ENOSYS" if host_module == "ENOSYS" else "EPERM")
    assert await _probe(sh, "sysctl") in ("EACCES", "EPERM")
    assert await _probe(sh, "hierarchy", "/tmp/cg") == "EPERM"


async def test_the_node_manages_its_cgroup_below_its_limits(unode: UserNode) -> None:
    sh = unode.shell
    name = f"gpc-{unode.node_id[:12]}"
    hier = "memory" if not nodecgroup.is_v2() else ""
    base = f"/sys/fs/cgroup/{hier}".rstrip("/")
    # Its own cgroup is the root of what it sees, and its children are its.
    seen = (await sh.run(["cat", "/proc/self/cgroup"])).stdout
    assert name not in seen
    await sh.run(["mkdir", f"{base}/jobs"])
    host_dir = nodecgroup.node_dirs(name)[0 if nodecgroup.is_v2() else _index(name, hier)]
    assert (host_dir / "jobs").is_dir()
    # The limits the host set on it are not its to raise; the host may.
    limit = "memory.max" if nodecgroup.is_v2() else "memory.limit_in_bytes"
    r = await sh.run(["sh", "-c", f"cat {base}/{limit} > {base}/{limit}"], check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    (host_dir / limit).write_text((host_dir / limit).read_text())


def _index(name: str, hier: str) -> int:
    dirs = nodecgroup.node_dirs(name)
    return next(i for i, d in enumerate(dirs) if d.parent.name == hier)


async def test_a_reboot_keeps_the_user_namespace_and_a_delete_removes_it(
    unode: UserNode,
) -> None:
    lay = node_layout(unode.fleet, unode.node_id)
    before = os.stat(lay.user_file).st_ino
    await unode.shell.run(["sh", "-c", "echo kept > /root/note"])
    await unode.provider.reboot(unode.node_id)
    shell = await unode.provider.shell(unode.node_id)
    assert (await shell.run(["cat", "/root/note"])).stdout.strip() == "kept"
    assert os.stat(lay.user_file).st_ino == before
    assert (await shell.run(["id", "-u"])).stdout.strip() == "0"
    await unode.provider.delete(unode.node_id)
    assert not lay.user_file.exists() and not lay.netns_path.exists()
    assert str(lay.user_file) not in host_run(["cat", "/proc/self/mountinfo"]).stdout


async def test_a_reprovisioned_node_owns_its_new_disks(unode: UserNode) -> None:
    """A reprovision (repair) wipes the node's disks and boots it on fresh
    ones: those must be shifted into the block again, or root in the node
    would find its own /tmp, /scratch and /root owned by nobody."""
    sh = unode.shell
    await sh.run(["sh", "-c", "echo old > /scratch/old"])
    await unode.provider.reprovision(unode.node_id)
    shell = await unode.provider.shell(unode.node_id)
    assert (await shell.run(["test", "-e", "/scratch/old"], check=False)).returncode != 0
    owners = await shell.run(["stat", "-c", "%u", "/tmp", "/scratch", "/root", "/var/lib"])
    assert owners.stdout.split() == ["0", "0", "0", "0"]
    await shell.run(["sh", "-c", "echo new > /tmp/t && echo new > /scratch/s && touch /root/r"])


async def test_a_volume_is_adopted_into_the_block_with_its_data(fleet: Fleet) -> None:
    """Files a volume held before its nodes had user namespaces keep their
    contents and their owners (shifted into the project's block)."""
    p = fleet.provider(userns=True)
    ids = idblocks.block(6)
    volume = await fleet.volumes.ensure("vol" + os.urandom(4).hex(), size_tib=1)
    data = fleet.volumes.path(volume.name) / "data"
    (data / "old").write_text("kept\n")
    os.chown(data / "old", 10001, 10001)
    spec = fleet.spec(fleet.cluster(), "u-vol-1", "h100-a-01", volume_id=volume.name, host_ids=ids)
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    seen = await sh.run(["stat", "-c", "%u %g", "/mnt/shared/old"])
    assert seen.stdout.split() == ["10001", "10001"]
    assert (await sh.run(["cat", "/mnt/shared/old"])).stdout == "kept\n"
    await sh.run(["sh", "-c", "echo new > /mnt/shared/new"])
    assert (data / "old").stat().st_uid == ids.first + 10001
    assert (data / "new").stat().st_uid == ids.first
