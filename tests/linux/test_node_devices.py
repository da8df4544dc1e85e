"""A node booted with the host's real devices (``NodeBoot.devices``): the
device nodes are the host's (bound, same major/minor), driver files it
cannot already see are bound read-only, what it sees through the shared /usr
is left alone, and every process of the node runs with memlock unlimited.

No GPU here: a "GPU" is a char device with /dev/null's numbers made with
mknod under tmp_path, the "driver library" a plain file.
"""

from __future__ import annotations

import asyncio
import os
import resource
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodetools import Fleet, new_id

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.linux import layout, machine, network
from gpuclusters.linux.devices import DeviceSet
from gpuclusters.linux.layout import DEFAULT_NS_DIR, NodeLayout
from gpuclusters.linux.machine import Daemon, NodeBoot
from gpuclusters.linux.shell import NamespaceShell
from gpuclusters.providers.netns.config import runtime_paths

CAP_SYS_RESOURCE = 24
ABSENT_DIR = "/usr/lib/gpuclusters-test-absent"
SHELL = os.path.realpath("/bin/sh")  # a file of the host's /usr


def expected_memlock() -> str:
    """What ``ulimit -l`` says in a node: unlimited where the hard limit can
    be raised (CAP_SYS_RESOURCE; a plain root host), else the hard limit
    (containers without that capability, like some CI sandboxes)."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    status = Path("/proc/self/status").read_text()
    caps = int(next(x for x in status.splitlines() if x.startswith("CapEff:")).split()[1], 16)
    if hard == resource.RLIM_INFINITY or caps & (1 << CAP_SYS_RESOURCE):
        return "unlimited"
    return str(hard // 1024)


@dataclass
class DeviceNode:
    shell: NodeShell
    hw: Path  # the fake host hardware: dev/, lib/
    lib: Path


def fake_char_device(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    path.chmod(0o666)


@pytest.fixture
async def node(fleet: Fleet, tmp_path: Path) -> AsyncIterator[DeviceNode]:
    hw = tmp_path / "hw"
    dev = hw / "dev"
    for name in ("nvidia0", "nvidiactl", "infiniband/uverbs0"):
        fake_char_device(dev / name)
    lib = hw / "lib" / "libnvidia-fake.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_text("fake driver library\n")
    devices = DeviceSet(
        device_nodes=(
            str(dev / "nvidia0"),
            str(dev / "nvidiactl"),
            str(dev / "infiniband/uverbs0"),
        ),
        mounts=(
            # tmp_path is below /tmp, which is the node's own: not visible, bound.
            (str(lib), str(lib)),
            # Seen through the shared read-only /usr already: left alone.
            (SHELL, SHELL),
            # Cannot be placed inside the shared read-only /usr: skipped.
            (str(lib), f"{ABSENT_DIR}/libnvidia-fake.so.1"),
            # Gone from the host: skipped.
            (str(hw / "gone"), str(hw / "gone")),
        ),
        gpu_count=1,
        dev_root=str(dev),
    )
    cluster_id = fleet.cluster()
    node_id = new_id()
    fleet.node_ids.add(node_id)
    lay = NodeLayout(node_id, DEFAULT_NS_DIR, fleet.home / "nodes")
    used = await network.host_subnets_in_pool()
    index = max(i for i in range(1, 255) if i not in used)
    address = layout.node_address(index, layout.FIRST_NODE_HOST)
    probe = "ulimit -l > /run/gpuclusters/memlock-at-boot; exec sleep 600"
    boot = NodeBoot(
        layout=lay,
        hostname="gpu-dev-node",
        network_index=index,
        address=address,
        run_dir=fleet.home / "run",
        gpus=8,  # ignored for device nodes once real devices are given
        devices=devices,
        daemons=(Daemon("probe", ("sh", "-c", probe)),),
        # As the provider does: the Python runtime (the daemon starter needs
        # its standard library after the pivot), the home masked.
        shares=runtime_paths(),
        masks=(fleet.home,),
    )
    await network.ensure_bridge(cluster_id, index)
    try:
        assert await machine.boot(boot, bridge=layout.bridge_name(cluster_id))
        yield DeviceNode(NamespaceShell(lay, hostname=boot.hostname, address=address), hw, lib)
    finally:
        await machine.destroy(lay)
        await network.delete_bridge(cluster_id)


async def out(shell: NodeShell, *argv: str) -> str:
    return (await shell.run(list(argv))).stdout.strip()


async def test_the_host_device_nodes_replace_the_simulated_ones(node: DeviceNode) -> None:
    kinds = await out(
        node.shell, "stat", "-c", "%n %F %t:%T", "/dev/nvidia0", "/dev/nvidiactl",
        "/dev/infiniband/uverbs0",
    )  # fmt: skip
    null = os.stat("/dev/null").st_rdev
    numbers = f"{os.major(null):x}:{os.minor(null):x}"
    assert kinds.splitlines() == [
        f"/dev/nvidia0 character special file {numbers}",
        f"/dev/nvidiactl character special file {numbers}",
        f"/dev/infiniband/uverbs0 character special file {numbers}",
    ]
    # The host's node works in the node (it is /dev/null underneath).
    assert await out(node.shell, "sh", "-c", "echo x > /dev/nvidia0 && echo written") == "written"
    # No simulated GPUs besides: gpus=8 made none.
    missing = await node.shell.run(["test", "-e", "/dev/nvidia1"], check=False)
    assert missing.returncode != 0


async def test_driver_files_are_bound_read_only_where_the_node_cannot_see_them(
    node: DeviceNode,
) -> None:
    lib = str(node.lib)
    assert await out(node.shell, "cat", lib) == "fake driver library"
    denied = await node.shell.run(["sh", "-c", f"echo x >> {lib}"], check=False)
    assert denied.returncode != 0 and "Read-only" in denied.stderr
    report = (await out(node.shell, "cat", "/run/gpuclusters/devices")).splitlines()
    assert report[:3] == [
        "device /dev/nvidia0",
        "device /dev/nvidiactl",
        "device /dev/infiniband/uverbs0",
    ]
    assert f"bound {lib}" in report
    assert f"visible {SHELL}" in report
    assert any(line.startswith(f"skipped {ABSENT_DIR}/") for line in report)
    assert f"gone {node.hw / 'gone'}" in report
    absent = await node.shell.run(["test", "-e", ABSENT_DIR], check=False)
    assert absent.returncode != 0  # nothing was written into the shared /usr
    assert not await asyncio.to_thread(os.path.exists, ABSENT_DIR)


async def test_every_process_of_the_node_has_memlock_unlimited(node: DeviceNode) -> None:
    expected = expected_memlock()
    # Commands (nsenter), ...
    assert await out(node.shell, "sh", "-c", "ulimit -l") == expected
    # ... the boot daemons (_nsinit) ...
    at_boot = await node.shell.read_file("/run/gpuclusters/memlock-at-boot")
    assert at_boot is not None and at_boot.decode().strip() == expected
    # ... and daemons spawned later (the node-ops helper).
    await node.shell.spawn("probe2", ["sh", "-c", "ulimit -l > /tmp/memlock; exec sleep 600"])
    for _ in range(100):
        later = await node.shell.read_file("/tmp/memlock")
        if later:
            break
    assert later is not None and later.decode().strip() == expected
