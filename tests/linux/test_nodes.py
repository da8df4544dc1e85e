"""Namespace nodes seen from inside: identity, filesystem, network, daemons.

Two clusters: A (nodes a1, a2, with a shared volume) and B (node b1).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodetools import (
    Fleet,
    host_exists,
    host_pid,
    host_read,
    host_run,
    node_layout,
    parent_pid,
    proc_state,
    reach,
    start_echo,
)

from gpuclusters.core.nodeshell import NodeCommandError, NodeShell
from gpuclusters.linux import nodecgroup
from gpuclusters.providers.base import InstanceState, PermanentProviderError
from gpuclusters.providers.fleet import load_fleet
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.registry import DEFAULT_NETNS_FLEET
from gpuclusters.providers.volumes import VolumeStore


@dataclass
class TwoClusters:
    provider: NetnsNodeProvider
    a1: NodeShell
    a2: NodeShell
    b1: NodeShell
    volume_dir: Path
    a1_id: str
    a2_id: str
    fleet: Fleet


@pytest.fixture
async def two(fleet: Fleet) -> TwoClusters:
    p = fleet.provider()
    volume = await fleet.volumes.ensure("vol" + os.urandom(4).hex(), size_tib=1)
    a, b = fleet.cluster(), fleet.cluster()
    vid = volume.name
    sa1 = fleet.spec(a, "a-node-1", "h100-a-01", volume_id=vid, cluster_name="ca")
    sa2 = fleet.spec(a, "a-node-2", "h100-a-02", volume_id=vid, cluster_name="ca")
    sb1 = fleet.spec(b, "b-node-1", "h100-b-01", cluster_name="cb")
    for spec in (sa1, sa2, sb1):
        inst = await p.create(spec)
        assert inst.state is InstanceState.RUNNING, inst
    return TwoClusters(
        p,
        await p.shell(sa1.node_id),
        await p.shell(sa2.node_id),
        await p.shell(sb1.node_id),
        volume / "data",
        sa1.node_id,
        sa2.node_id,
        fleet,
    )


async def out(shell: NodeShell, *argv: str) -> str:
    return (await shell.run(list(argv))).stdout.strip()


async def test_identity_addresses_and_node_file(two: TwoClusters) -> None:
    assert await out(two.a1, "hostname") == "a-node-1"
    assert await out(two.b1, "hostname") == "b-node-1"
    assert two.a1.address.endswith(".10") and two.a2.address.endswith(".11")
    assert two.a1.address.rsplit(".", 1)[0] == two.a2.address.rsplit(".", 1)[0]
    assert two.a1.address.rsplit(".", 1)[0] != two.b1.address.rsplit(".", 1)[0]
    addr = await out(two.a1, "ip", "-4", "-o", "addr", "show", "eth0")
    assert f"inet {two.a1.address}/24" in addr
    route = await out(two.a1, "ip", "route", "show", "default")
    assert route.startswith("default via " + two.a1.address.rsplit(".", 1)[0] + ".1")
    info = json.loads(await out(two.a1, "cat", "/etc/gpuclusters/node.json"))
    assert info["name"] == "a-node-1" and info["host"] == "h100-a-01"
    assert info["address"] == two.a1.address and info["gpu_type"] == "H100_SXM"
    assert set(info) >= {"node_id", "cluster_id", "cluster_name", "compute_class"}


async def test_gpu_devices_and_private_dev(two: TwoClusters) -> None:
    names = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl"]
    kinds = (await out(two.a1, "stat", "-c", "%F %t:%T", *names)).splitlines()
    assert kinds == [f"character special file c3:{i:x}" for i in range(8)] + [
        "character special file c3:ff"
    ]
    # /dev is the node's own: no host disks, its own ptys.
    assert (await two.a1.run(["test", "-e", "/dev/vda"], check=False)).returncode != 0
    assert await out(two.a1, "readlink", "/dev/ptmx") == "pts/ptmx"
    assert await out(two.a1, "sh", "-c", "echo ok > /dev/null && head -c3 /dev/zero | wc -c") == "3"


async def test_scratch_and_shared_volume(two: TwoClusters) -> None:
    await two.a1.run(["sh", "-c", "echo local > /scratch/mine"])
    assert await out(two.a1, "stat", "-c", "%a", "/scratch", "/tmp") == "1777\n1777"
    assert (await two.a2.run(["test", "-e", "/scratch/mine"], check=False)).returncode != 0
    await two.a1.run(["sh", "-c", "echo from-a1 > /mnt/shared/hello"])
    assert await out(two.a2, "cat", "/mnt/shared/hello") == "from-a1"
    assert (two.volume_dir / "hello").read_text() == "from-a1\n"
    # Cluster B has no volume: nothing at /mnt/shared.
    assert (await two.b1.run(["test", "-e", "/mnt/shared/hello"], check=False)).returncode != 0


async def test_etc_is_private_to_each_node(two: TwoClusters) -> None:
    marker = "/etc/gpc-test-" + os.urandom(4).hex()
    assert await two.a1.write_file(marker, b"node a1\n") is True
    assert await two.a1.write_file(marker, b"node a1\n") is False  # unchanged
    assert await two.a1.write_file(marker, b"node a1\n", mode=0o600) is True  # mode differs
    assert await two.a1.read_file(marker) == b"node a1\n"
    assert not host_exists(marker)
    assert await two.a2.read_file(marker) is None
    # A host file is visible read-through, and writing it stays in the node.
    hostname_on_host = host_read("/etc/hostname")
    assert await out(two.a1, "cat", "/etc/hostname") == "a-node-1"
    assert host_read("/etc/hostname") == hostname_on_host
    await two.a1.run(["sh", "-c", "echo x >> /var/gpc-test-var"])
    assert not host_exists("/var/gpc-test-var")
    # Host paths outside the node's own ones are read-only.
    r = await two.a1.run(["touch", "/usr/gpc-test"], check=False)
    assert r.returncode != 0 and not host_exists("/usr/gpc-test")


async def test_processes_and_ipc_are_private_to_each_node(two: TwoClusters) -> None:
    """Each node has its own PID and IPC namespaces: it sees and signals its
    own processes only, and its PID 1 is its own init. Every check is also
    made from the host, where the same thing is visible, so the test fails
    if the boundary is absent."""
    await two.a2.spawn("neighbour", ["sleep", "600"])
    await two.a1.spawn("mine", ["sleep", "600"])
    try:
        pidfile = await two.a2.read_file("/run/gpuclusters-daemons/neighbour.pid") or b""
        n_pid = int(pidfile.split()[0])
        neighbour = host_pid(node_layout(two.fleet, two.a2_id), n_pid)
        assert neighbour is not None and host_exists(f"/proc/{neighbour}")  # the host sees it
        listed = await out(two.a1, "ps", "-e", "-o", "pid=,comm=")
        comms = [line.split(None, 1)[1] for line in listed.splitlines()]
        assert "sleep" in comms and comms.count("sleep") == 1, listed  # its own only
        pids = [int(line.split()[0]) for line in listed.splitlines()]
        assert max(pids) < 1000 and os.getpid() not in pids, listed
        init = await out(two.a1, "cat", "/proc/1/cmdline")
        assert "_nsinit" in init, init  # PID 1 is the node's init, not the host's
        assert await two.a1.read_file(f"/proc/{neighbour}/status") is None
        r = await two.a1.run(["kill", "-9", str(neighbour)], check=False)
        assert r.returncode != 0
        assert await two.a2.is_running("neighbour") is True
        # The host's own PID 1 and the test process are invisible too.
        assert await two.a1.read_file(f"/proc/{os.getpid()}/cmdline") is None
        # IPC: a System V segment made on the host is not in the node.
        made = host_run(["ipcmk", "-M", "4096"], check=True).stdout
        shmid = made.strip().rsplit(None, 1)[-1]
        try:
            assert shmid in host_run(["ipcs", "-m"]).stdout
            assert shmid not in await out(two.a1, "ipcs", "-m")
        finally:
            host_run(["ipcrm", "-m", shmid])
    finally:
        await two.a2.stop("neighbour")
        await two.a1.stop("mine")


async def test_tcp_within_cluster_but_not_across(two: TwoClusters) -> None:
    await start_echo(two.a2)
    await start_echo(two.b1)
    assert await reach(two.a1, two.a2.address) == "a-node-2"
    assert await reach(two.a1, two.b1.address) is None
    assert await reach(two.b1, two.a2.address) is None
    assert await reach(two.b1, two.b1.address) == "b-node-1"


async def test_ping_within_cluster_but_not_across(two: TwoClusters) -> None:
    if (await two.a1.run(["sh", "-c", "command -v ping"], check=False)).returncode != 0:
        pytest.skip("ping is not installed (apt package iputils-ping)")
    ok = await two.a1.run(["ping", "-c1", "-W1", two.a2.address], check=False)
    assert ok.returncode == 0, ok
    bad = await two.a1.run(["ping", "-c1", "-W1", two.b1.address], check=False)
    assert bad.returncode != 0


async def test_daemons_spawn_stop_and_logs(two: TwoClusters) -> None:
    sh = two.a1
    assert await sh.is_running("sleeper") is False
    await sh.spawn(
        "sleeper",
        ["sh", "-c", 'echo "started as $GREETING"; exec sleep 600'],
        env={"GREETING": "hi"},
    )
    assert await sh.is_running("sleeper") is True
    pid = int((await sh.read_file("/run/gpuclusters-daemons/sleeper.pid") or b"").split()[0])
    await sh.spawn("sleeper", ["sleep", "1"])  # already running: nothing happens
    assert (
        int((await sh.read_file("/run/gpuclusters-daemons/sleeper.pid") or b"").split()[0]) == pid
    )
    # Detached: its own session, a child of the node's init (PID 1 of the
    # node's PID namespace), as seen in the node's /proc.
    stat = (await sh.read_file(f"/proc/{pid}/stat") or b"").decode()
    fields = stat.rsplit(")", 1)[1].split()
    assert (int(fields[1]), int(fields[3])) == (1, pid), stat  # ppid, sid
    host = host_pid(node_layout(two.fleet, two.a1_id), pid)
    assert host is not None and parent_pid(host) != os.getpid() and os.getsid(host) == host
    assert await two.a2.is_running("sleeper") is False  # another node's daemon
    log = await sh.read_file("/var/log/gpuclusters/sleeper.log")
    assert log is not None and b"started as hi" in log
    await sh.stop("sleeper", timeout_s=5)
    assert await sh.is_running("sleeper") is False
    assert proc_state(host) in (None, "Z")
    await sh.stop("sleeper")  # stopping a stopped daemon is fine
    with pytest.raises(NodeCommandError, match="no-such-program"):
        await sh.spawn("broken", ["no-such-program-gpc"])
    assert await sh.is_running("broken") is False


async def test_run_as_user_and_errors(two: TwoClusters) -> None:
    sh = two.a1
    await sh.run(["useradd", "-m", "-s", "/bin/sh", "gpcalice"])
    assert await out(sh, "id", "-un") == "root"
    r = await sh.run(["sh", "-c", "id -un; echo $HOME; pwd"], user="gpcalice")
    assert r.stdout.split() == ["gpcalice", "/home/gpcalice", "/"]
    with pytest.raises(KeyError):
        pwd.getpwnam("gpcalice")  # the host never heard of her
    assert (await two.a2.run(["id", "gpcalice"], check=False)).returncode != 0
    assert await sh.write_file("/home/gpcalice/note", b"hi", owner="gpcalice", mode=0o600)
    assert await out(sh, "stat", "-c", "%U %a", "/home/gpcalice/note") == "gpcalice 600"
    assert (await sh.run(["cat"], stdin=b"piped")).stdout == "piped"
    with pytest.raises(NodeCommandError) as err:
        await sh.run(["sh", "-c", "echo oops >&2; exit 3"])
    assert err.value.result.returncode == 3 and "oops" in str(err.value)
    slow = await sh.run(["sleep", "5"], timeout_s=0.3, check=False)
    assert slow.returncode == 124
    env = await out(sh, "env")
    assert "GPUCLUSTERS" not in env and "PATH=" in env


async def test_exec_argv_runs_non_interactively(two: TwoClusters) -> None:
    argv = two.b1.exec_argv(["sh", "-c", "hostname; id -un"])
    done = host_run(argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["b-node-1", "root"]
    await two.b1.run(["useradd", "gpcbob"])
    argv = two.b1.exec_argv(["id", "-un"], user="gpcbob")
    done = host_run(argv)
    assert done.stdout.strip() == "gpcbob", done.stderr


async def test_create_is_idempotent_and_checks_requests(fleet: Fleet) -> None:
    p = fleet.provider()
    c = fleet.cluster()
    spec = fleet.spec(c, "idem-1", "h100-a-01")
    first = await p.create(spec)
    again = await p.create(spec)
    assert first == again and again.state is InstanceState.RUNNING
    assert [i.node_id for i in await p.list_instances()] == [spec.node_id]
    with pytest.raises(PermanentProviderError, match="already runs"):
        await p.create(fleet.spec(c, "idem-2", "h100-a-01"))
    with pytest.raises(PermanentProviderError, match="unknown host"):
        await p.create(fleet.spec(c, "idem-3", "nowhere"))
    with pytest.raises(PermanentProviderError, match="hostname"):
        await p.create(fleet.spec(c, "bad name!", "h100-a-02"))
    assert [i.node_id for i in await p.list_instances()] == [spec.node_id]
    assert (await p.status("0" * 32)).state is InstanceState.MISSING


@pytest.fixture(params=["/var/tmp", "/opt"])
def var_home(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """The fleet, but with its home under /var/tmp (where the host's /var
    was once the node's /var overlay's lower layer, as a home in /var/lib
    would be) or /opt (a host directory nodes see read-only)."""
    home = Path(tempfile.mkdtemp(prefix="gpc-test-home-", dir=request.param))
    original = fleet.home
    fleet.home = home
    try:
        yield fleet
    finally:
        fleet.home = original
        # The fleet fixture's cleanup runs after this one: give it this home.
        fleet.extra_homes.append(home)


async def test_control_plane_home_is_hidden_from_nodes(var_home: Fleet) -> None:
    p = var_home.provider()
    volume = await var_home.volumes.ensure("hid" + os.urandom(3).hex(), size_tib=1)
    spec = var_home.spec(var_home.cluster(), "hidden-1", "h100-a-01", volume_id=volume.name)
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    home = str(var_home.home)
    listed = await sh.run(["ls", "-A", home], check=False)
    if home.startswith("/var/"):
        # Not the host's /var at all: not there.
        assert listed.returncode != 0 and "No such file" in listed.stderr, listed
    else:
        assert listed.returncode == 0 and listed.stdout == "", listed  # masked: empty
    assert (await sh.run(["touch", f"{home}/x"], check=False)).returncode != 0
    await sh.run(["sh", "-c", "echo v > /mnt/shared/v; echo s > /scratch/s"])
    assert (volume / "data" / "v").read_text() == "v\n"
    assert await out(sh, "ls", "/run/gpuclusters/control") == ""


@pytest.fixture
def host_secrets() -> Iterator[dict[str, str]]:
    """On the host: a login account with a password hash, a TLS private key
    and a file in /var/tmp, as an operator's machine has them."""
    tag = os.urandom(3).hex()
    user, key = f"gpch{tag}", f"/etc/ssl/private/gpc-test-{tag}.key"
    var_file = f"/var/tmp/gpc-test-{tag}"
    host_run(["useradd", "-u", str(20000 + int(tag, 16) % 10000), "-M", user], check=True)
    pw_hash = "$6$gpctest$" + tag * 4
    host_run(["usermod", "-p", pw_hash, user], check=True)
    Path(key).write_text("-----BEGIN PRIVATE KEY-----\n" + tag + "\n")
    Path(var_file).write_text("host data\n")
    try:
        yield {"user": user, "hash": pw_hash, "key": key, "var_file": var_file}
    finally:
        host_run(["userdel", user])
        Path(key).unlink(missing_ok=True)
        Path(var_file).unlink(missing_ok=True)


async def test_host_accounts_secrets_and_var_are_not_the_nodes(
    fleet: Fleet, host_secrets: dict[str, str]
) -> None:
    """A node has its own accounts (the host's system accounts, locked),
    sees none of the host's secrets in /etc and none of its /var. Each
    thing is first shown to be there on the host."""
    user, key, var_file = host_secrets["user"], host_secrets["key"], host_secrets["var_file"]
    assert pwd.getpwnam(user).pw_uid >= 20000
    assert host_secrets["hash"] in (host_read("/etc/shadow") or b"").decode()
    assert host_exists(key) and host_exists(var_file)
    p = fleet.provider()
    spec = fleet.spec(fleet.cluster(), "own-etc-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    # The host's login is no account of the node: a project member of that
    # name gets the uid the project gives (the failure of issue 24).
    assert (await sh.run(["id", user], check=False)).returncode != 0
    await sh.run(["useradd", "-u", "10001", "-M", user])
    assert (await out(sh, "id", "-u", user)) == "10001"
    assert pwd.getpwnam(user).pw_uid != 10001  # the host's account is untouched
    # System accounts are there (daemons run as them), locked.
    assert (await out(sh, "id", "-u", "root")) == "0"
    assert (await sh.run(["id", "nobody"], check=False)).returncode == 0
    shadow = (await sh.read_file("/etc/shadow") or b"").decode()
    assert "root:*:" in shadow and host_secrets["hash"] not in shadow
    assert all(line.split(":")[1] in ("*", "!") for line in shadow.splitlines()), shadow
    # Secrets whited out; other host configuration still reads through.
    assert await sh.read_file(key) is None
    assert await sh.read_file("/etc/os-release") == host_read("/etc/os-release")
    for host_key in host_run(["sh", "-c", "ls /etc/ssh/ssh_host_*_key"]).stdout.split():
        assert await sh.read_file(host_key) is None, host_key
    # A key the node writes over a whited-out path is its own.
    await sh.write_file(key, b"node key\n", mode=0o600)
    assert await sh.read_file(key) == b"node key\n"
    assert (host_read(key) or b"").startswith(b"-----BEGIN")
    # /var is the node's own: the host's files are not there.
    assert await sh.read_file(var_file) is None
    assert (await out(sh, "stat", "-c", "%a", "/var/tmp")) == "1777"
    assert (await out(sh, "readlink", "/var/run")) == "/run"
    # Kept across a reboot (the upper layer is the node's disk).
    await p.reboot(spec.node_id)
    assert (await out(sh, "id", "-u", user)) == "10001"


FORKS = 1200  # more than the smallest pids limit a node gets (1024)


async def test_node_processes_share_the_nodes_cgroup_and_its_limits(fleet: Fleet) -> None:
    """Every process of a node (its init, daemons, helpers) is in the node's
    cgroup, whose limits bound them: a fork bomb in a node stops at its pids
    limit, while the host itself can start as many processes."""
    # A share small enough for every floor (1024 pids) whatever the host's
    # pid_max: up to the kernel's largest, 4194304, which Debian 12 with
    # systemd sets (and a new PID namespace starts with).
    share = 1024 / 4194304
    p = fleet.provider(node_share=share)
    spec = fleet.spec(fleet.cluster(), "limits-1", "h100-a-01")
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    lay = node_layout(fleet, spec.node_id)
    limits = nodecgroup.this_host_share(share)
    assert limits.pids == 1024
    leaves = [Path(f).parent for f in nodecgroup.leaf_procs(lay.cgroup_name)]
    assert leaves, "no cgroup hierarchy found"
    top = leaves[0].parent
    pids_dir = next(d.parent for d in leaves if (d.parent / "pids.max").exists())
    assert (pids_dir / "pids.max").read_text().strip() == "1024"
    mem = [d.parent for d in leaves if (d.parent / "memory.limit_in_bytes").exists()]
    for d in mem:
        assert int((d / "memory.limit_in_bytes").read_text()) == limits.memory_bytes
    assert top.name == lay.cgroup_name
    await sh.spawn("sleeper", ["sleep", "600"])
    pid = int((await sh.read_file("/run/gpuclusters-daemons/sleeper.pid") or b"").split()[0])
    for who in (pid, 1, "self"):  # a daemon, the init, the helper's worker
        cgroups = (await sh.read_file(f"/proc/{who}/cgroup") or b"").decode()
        assert f"/{lay.cgroup_name}/node" in cgroups, (who, cgroups)
    bomb = (
        f'n=0; p=; for i in $(seq {FORKS}); do sleep 120 >/dev/null 2>&1 & p="$p $!"; '
        "n=$((n+1)); done; echo $n; kill $p 2>/dev/null; true"
    )
    # The host (no node boundary) starts them all.
    host = host_run(["sh", "-c", bomb], check=True)
    assert host.stdout.split()[0] == str(FORKS)
    node = await sh.run(["sh", "-c", bomb], check=False)
    # A shell that cannot fork stops with an error before counting them all.
    assert node.returncode != 0 or int(node.stdout.split()[0]) < FORKS, node
    assert int((pids_dir / "pids.max").read_text()) == 1024
    assert await sh.is_running("sleeper") is True  # the node itself survives


async def test_volumes_outside_the_home_are_hidden_except_the_nodes_own(fleet: Fleet) -> None:
    """Volumes kept outside the control plane's home (GPUCLUSTERS_VOLUMES_DIR
    below a host directory nodes see, here /opt) are masked: a node reaches
    its cluster's volume at /mnt/shared and no other project's."""
    vols = Path(tempfile.mkdtemp(prefix="gpc-test-vols-", dir="/opt"))
    try:
        p = NetnsNodeProvider(
            NetnsProviderConfig(
                fleet=load_fleet(DEFAULT_NETNS_FLEET), home=fleet.home, spawn_agent=False,
                volumes_dir=vols,
            )
        )  # fmt: skip
        store = VolumeStore(vols)
        tag = os.urandom(3).hex()
        mine = await store.ensure("mine" + tag, size_tib=1)
        other = await store.ensure("other" + tag, size_tib=1)
        await asyncio.to_thread((other / "data" / "secret").write_text, "project b\n")
        spec = fleet.spec(fleet.cluster(), "vols-1", "h100-a-01", volume_id=mine.name)
        await p.create(spec)
        sh = await p.shell(spec.node_id)
        assert host_exists(str(other / "data" / "secret"))  # there, on the host
        assert await out(sh, "ls", "-A", str(vols)) == ""  # masked in the node
        assert await sh.read_file(str(other / "data" / "secret")) is None
        await sh.run(["sh", "-c", "echo mine > /mnt/shared/f"])
        assert host_read(str(mine / "data" / "f")) == b"mine\n"
        await p.delete(spec.node_id)
    finally:
        await asyncio.to_thread(shutil.rmtree, vols, True)
