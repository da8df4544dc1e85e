"""Reboot, reprovision, delete, server restart, service nodes, the agent."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
from nodetools import (
    Fleet,
    alive,
    host_pid,
    host_run,
    host_start,
    leftovers,
    node_layout,
    reach,
    start_echo,
)

from gpuclusters.linux import layout, network, procs, sysmount
from gpuclusters.providers.base import InstanceState, PermanentProviderError, ProviderError


async def test_reboot_keeps_disks_kills_processes_fresh_run(fleet: Fleet) -> None:
    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "rb-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    await sh.run(["sh", "-c", "echo s > /scratch/s; echo t > /tmp/t; echo r > /run/r"])
    await sh.run(["sh", "-c", "echo e > /etc/gpc-kept"])
    await sh.spawn("sleeper", ["sleep", "600"])
    node_pid = int((await sh.read_file("/run/gpuclusters-daemons/sleeper.pid") or b"0").split()[0])
    pid = host_pid(node_layout(fleet, spec.node_id), node_pid)
    assert pid is not None and alive(pid)
    # A process started by hand, not through spawn, dies too.
    stray = host_start(sh.exec_argv(["sleep", "600"]))
    try:
        inst = await p.reboot(spec.node_id)
        assert inst.state is InstanceState.RUNNING
        assert not alive(pid)
        assert not alive(stray.pid)
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
    assert (await sh.read_file("/scratch/s")) == b"s\n"
    assert (await sh.read_file("/tmp/t")) == b"t\n"
    assert (await sh.read_file("/etc/gpc-kept")) == b"e\n"
    assert (await sh.read_file("/run/r")) is None
    assert await sh.is_running("sleeper") is False
    assert (await sh.run(["hostname"])).stdout.strip() == "rb-1"


async def test_reprovision_wipes_disks(fleet: Fleet) -> None:
    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "rp-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    await sh.run(["sh", "-c", "echo s > /scratch/s; echo t > /tmp/t; echo e > /etc/gpc-gone"])
    await sh.run(["useradd", "gpcwiped"])
    inst = await p.reprovision(spec.node_id)
    assert inst.state is InstanceState.RUNNING
    for path in ("/scratch/s", "/tmp/t", "/etc/gpc-gone"):
        assert await sh.read_file(path) is None, path
    assert (await sh.run(["id", "gpcwiped"], check=False)).returncode != 0
    assert (await sh.read_file("/etc/hostname")) == b"rp-1\n"
    with pytest.raises(PermanentProviderError):
        await p.reboot("f" * 32)


async def test_delete_leaves_nothing_and_is_idempotent(fleet: Fleet) -> None:
    p = fleet.provider()
    volume = await fleet.volumes.ensure("keepme" + os.urandom(3).hex(), size_tib=1)
    c = fleet.cluster()
    s1 = fleet.spec(c, "del-1", "h100-a-01", volume_id=volume.name)
    s2 = fleet.spec(c, "del-2", "h100-a-02", volume_id=volume.name)
    await p.create(s1)
    await p.create(s2)
    login = await p.ensure_service_node(
        cluster_id=c, cluster_name="del", role="login", volume_id=volume.name
    )
    sh = await p.shell(s1.node_id)
    await sh.run(["sh", "-c", "echo data > /mnt/shared/file; echo x > /scratch/x"])
    await sh.spawn("sleeper", ["sleep", "600"])
    lay = p_layout(fleet, s1.node_id)
    pids = procs.pids_in({i for i in [sysmount.ns_inode(lay.netns_path)] if i})
    assert pids

    await p.delete(s1.node_id)
    assert not any(alive(pid) for pid in pids)
    assert leftovers([s1.node_id], [], fleet.home) == []
    assert network.link_exists(layout.bridge_name(c))  # the cluster still has nodes
    assert (await p.status(s1.node_id)).state is InstanceState.MISSING
    await p.delete(s1.node_id)  # again: nothing to do, no error

    service_ids = fleet.recorded_ids() - {s2.node_id}
    await p.delete(s2.node_id)
    assert network.link_exists(layout.bridge_name(c))  # the login node still uses it
    assert (await login.run(["hostname"])).stdout.strip() == "del-login"
    await p.delete_service_nodes(cluster_id=c)
    await p.delete_service_nodes(cluster_id=c)
    assert leftovers([s1.node_id, s2.node_id, *service_ids], [c], fleet.home) == []
    assert (volume / "data" / "file").read_text() == "data\n"  # the volume is not the node's
    assert await p.list_instances() == []
    assert not list((fleet.home / "nodes").iterdir())
    assert str(fleet.home) not in host_run(["findmnt", "-rn", "-o", "TARGET"]).stdout


def p_layout(fleet: Fleet, node_id: str) -> layout.NodeLayout:
    return layout.NodeLayout(node_id, layout.DEFAULT_NS_DIR, fleet.home / "nodes")


async def test_restarted_provider_adopts_nodes_and_sees_them_vanish(fleet: Fleet) -> None:
    first = fleet.provider()
    c = fleet.cluster()
    s1 = fleet.spec(c, "adopt-1", "h100-a-01")
    s2 = fleet.spec(c, "adopt-2", "h100-b-01")
    await first.create(s1)
    await first.create(s2)
    await (await first.shell(s1.node_id)).run(["sh", "-c", "echo kept > /scratch/k"])
    await first.close()
    del first

    second = fleet.provider()  # a restarted server: same home, new object
    assert {i.node_id: i.state for i in await second.list_instances()} == {
        s1.node_id: InstanceState.RUNNING,
        s2.node_id: InstanceState.RUNNING,
    }
    sh1 = await second.shell(s1.node_id)
    assert (await sh1.run(["hostname"])).stdout.strip() == "adopt-1"

    # Torn down behind the provider's back (as a host reboot would):
    lay1, lay2 = p_layout(fleet, s1.node_id), p_layout(fleet, s2.node_id)
    sysmount.unmount(lay1.mnt_file)
    host_run(["ip", "netns", "del", lay2.netns], check=True)
    st1, st2 = await second.status(s1.node_id), await second.status(s2.node_id)
    assert st1.state is InstanceState.MISSING and "mount namespace" in st1.message
    assert st2.state is InstanceState.MISSING and "network namespace" in st2.message

    # Asked again, the provider makes the node again, keeping its disks.
    assert (await second.create(s1)).state is InstanceState.RUNNING
    assert (await second.create(s2)).state is InstanceState.RUNNING
    assert await sh1.read_file("/scratch/k") == b"kept\n"
    await start_echo(await second.shell(s2.node_id))
    assert await reach(sh1, (await second.shell(s2.node_id)).address) == "adopt-2"

    # The bridge too (all a host reboot leaves is the state file and disks).
    host_run(["ip", "link", "del", layout.bridge_name(c)], check=True)
    assert "cluster bridge" in (await second.status(s1.node_id)).message
    assert (await second.create(s1)).state is InstanceState.RUNNING
    # s2's veth lost its bridge with it: missing until it is asked for again.
    assert "bridge" in (await second.status(s2.node_id)).message
    assert (await second.create(s2)).state is InstanceState.RUNNING
    assert await reach(sh1, (await second.shell(s2.node_id)).address) == "adopt-2"


async def test_service_nodes(fleet: Fleet) -> None:
    p = fleet.provider()
    volume = await fleet.volumes.ensure("svc" + os.urandom(3).hex(), size_tib=1)
    c = fleet.cluster()
    gpu = fleet.spec(c, "demo-node-1", "h100-a-01", volume_id=volume.name, cluster_name="demo")
    await p.create(gpu)
    ctl = await p.ensure_service_node(
        cluster_id=c, cluster_name="demo", role="controller", volume_id=volume.name
    )
    again = await p.ensure_service_node(
        cluster_id=c, cluster_name="demo", role="controller", volume_id=volume.name
    )
    assert (
        (ctl.hostname, ctl.address)
        == (again.hostname, again.address)
        == (
            "demo-controller",
            ctl.address,
        )
    )
    assert (await ctl.run(["hostname"])).stdout.strip() == "demo-controller"
    assert (await ctl.run(["test", "-e", "/dev/nvidia0"], check=False)).returncode != 0
    await ctl.run(["sh", "-c", "echo from-ctl > /mnt/shared/ctl"])
    node = await p.shell(gpu.node_id)
    assert await node.read_file("/mnt/shared/ctl") == b"from-ctl\n"
    await start_echo(ctl)
    assert await reach(node, ctl.address) == "demo-controller"
    # Service nodes hold no host and are no provider instances (no orphans).
    assert [i.node_id for i in await p.list_instances()] == [gpu.node_id]


@pytest.mark.skipif(
    importlib.util.find_spec("gpuclusters.agent") is None, reason="no gpuclusters.agent"
)
async def test_gpu_nodes_start_the_agent(fleet: Fleet) -> None:
    fleet.spawn_agent = True
    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "agent-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    assert await sh.is_running("agent")
    await p.reboot(spec.node_id)
    assert await sh.is_running("agent")


async def test_concurrent_creates_and_deletes(fleet: Fleet) -> None:
    p = fleet.provider()
    x, y = fleet.cluster(), fleet.cluster()
    specs = [
        fleet.spec(x, "cx-1", "h100-a-01"),
        fleet.spec(y, "cy-1", "h100-b-01"),
        fleet.spec(x, "cx-2", "h100-a-02"),
        fleet.spec(y, "cy-2", "h100-b-02"),
    ]
    done = await asyncio.gather(*(p.create(s) for s in specs))
    assert all(i.state is InstanceState.RUNNING for i in done)
    shells = [await p.shell(s.node_id) for s in specs]
    addresses = sorted(sh.address for sh in shells)
    nets = {a.rsplit(".", 1)[0] for a in addresses}
    assert len(nets) == 2 and {a.rsplit(".", 1)[1] for a in addresses} == {"10", "11"}
    await asyncio.gather(*(p.delete(s.node_id) for s in specs))
    assert leftovers([s.node_id for s in specs], [x, y], fleet.home) == []


async def test_a_boot_cut_short_is_never_used_and_is_redone(fleet: Fleet) -> None:
    """A server killed while a node's boot runs can leave its namespaces
    pinned but its root not built. Such a node must read MISSING, give out
    no shell (commands there would write to the host's mounts), and boot
    again from scratch when asked."""
    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "cut-1", "h100-a-01")
    await p.create(spec)
    node = p_layout(fleet, spec.node_id)
    (node.dir / "booted").unlink()  # as if unshare had been killed mid-boot
    assert (await p.status(spec.node_id)).state is InstanceState.MISSING
    with pytest.raises(ProviderError, match="not booted"):
        await p.shell(spec.node_id)
    assert (await p.create(spec)).state is InstanceState.RUNNING
    sh = await p.shell(spec.node_id)
    assert (await sh.read_file("/etc/hostname")) == b"cut-1\n"


def _helper_pids() -> set[int]:
    """Kept `_nodeops.py --serve` helpers that are children of this process."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"--serve" in cmd and any(c.endswith(b"_nodeops.py") for c in cmd):
            found.add(int(entry))
    return found


async def test_kept_helpers_are_reused_replaced_and_closed(fleet: Fleet) -> None:
    from gpuclusters.linux.shell import MAX_IDLE_HELPERS, close_helpers

    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "kh-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    before = _helper_pids()
    for i in range(20):  # one after another: one helper serves them all
        assert await sh.write_file(f"/tmp/f{i}", b"x") is True
    assert await sh.read_file("/tmp/f19") == b"x"
    first = _helper_pids() - before
    assert len(first) == 1, first
    # Concurrent ops use several, and at most MAX_IDLE_HELPERS stay.
    await asyncio.gather(*(sh.read_file(f"/tmp/f{i}") for i in range(12)))
    assert 1 <= len(_helper_pids() - before) <= MAX_IDLE_HELPERS
    # A helper killed under us (as powering the node off does) is replaced:
    # the op still answers.
    for pid in _helper_pids() - before:
        os.kill(pid, 9)
    assert await sh.read_file("/tmp/f3") == b"x"
    # A reboot kills the helpers with everything in the node; the next op
    # runs in the new namespaces, not in the old ones.
    await sh.run(["sh", "-c", "echo r > /run/marker"])
    assert await sh.read_file("/run/marker") == b"r\n"
    await p.reboot(spec.node_id)
    assert await sh.read_file("/run/marker") is None
    await close_helpers()
    await asyncio.sleep(0.2)
    assert _helper_pids() - before == set()
    await p.delete(spec.node_id)
