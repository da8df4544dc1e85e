"""Helpers for tests with nodes: the ``Fleet`` the ``fleet`` fixture hands
out, a leftover finder, small programs run inside nodes (with the host's
python3, which nodes see through their read-only /usr), and sync looks at
the host (async tests must not block the loop inline)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.linux import layout, network, sysmount
from gpuclusters.linux.devices import DeviceSet
from gpuclusters.linux.layout import DEFAULT_NS_DIR, NodeLayout
from gpuclusters.providers.base import NodeSpec
from gpuclusters.providers.fleet import load_fleet
from gpuclusters.providers.netns.config import NetnsProviderConfig, runtime_paths
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.netns.state import ProviderState
from gpuclusters.providers.registry import DEFAULT_NETNS_FLEET
from gpuclusters.providers.volumes import VolumeStore


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Fleet:
    """Providers over one test home, plus bookkeeping for the cleanup."""

    home: Path
    spawn_agent: bool = False
    node_ids: set[str] = field(default_factory=set)
    cluster_ids: set[str] = field(default_factory=set)
    extra_homes: list[Path] = field(default_factory=list)

    @property
    def volumes(self) -> VolumeStore:
        return VolumeStore(self.home / "volumes")

    def provider(
        self,
        *,
        node_share: float = 1.0,
        userns: bool = False,
        image: Path | None = None,
        devices: DeviceSet | None = None,
        extra_shares: tuple[Path, ...] = (),
    ) -> NetnsNodeProvider:
        return NetnsNodeProvider(
            NetnsProviderConfig(
                shares=runtime_paths() + extra_shares,
                fleet=load_fleet(DEFAULT_NETNS_FLEET),
                home=self.home,
                spawn_agent=self.spawn_agent,
                node_share=node_share,
                userns=userns,
                image=image,
                devices=devices,
            )
        )

    def cluster(self) -> str:
        cid = new_id()
        self.cluster_ids.add(cid)
        return cid

    def spec(
        self,
        cluster_id: str,
        name: str,
        host: str,
        *,
        volume_id: str | None = None,
        cluster_name: str = "test",
        host_ids: IdBlock | None = None,
    ) -> NodeSpec:
        node_id = new_id()
        self.node_ids.add(node_id)
        return NodeSpec(
            node_id=node_id,
            name=name,
            cluster_id=cluster_id,
            cluster_name=cluster_name,
            host=host,
            gpu_type="H100_SXM",
            compute_class="standard",
            volume_id=volume_id,
            host_ids=host_ids,
        )

    def recorded_ids(self) -> set[str]:
        state = ProviderState.load(self.home / "netns-provider.json")
        return set(state.nodes)


def leftovers(node_ids: Iterable[str], cluster_ids: Iterable[str], home: Path) -> list[str]:
    """Everything of these nodes and clusters still on the host."""
    found: list[str] = []
    netns = host_run(["ip", "netns", "list"]).stdout
    mounts = sysmount.mount_points()
    for node_id in node_ids:
        lay = NodeLayout(node_id, DEFAULT_NS_DIR, home / "nodes")
        if lay.netns in netns:
            found.append(f"netns {lay.netns}")
        if network.link_exists(lay.veth):
            found.append(f"veth {lay.veth}")
        pins = (*lay.ns_files, lay.cgroup_file, lay.user_file, lay.netns_path)
        for f in (*pins, lay.user_file.with_suffix(".userids")):
            if str(f) in mounts or f.exists():
                found.append(f"pin {f}")
        if lay.dir.exists():
            found.append(f"dir {lay.dir}")
    for cid in cluster_ids:
        if network.link_exists(layout.bridge_name(cid)):
            found.append(f"bridge {layout.bridge_name(cid)}")
    found += [f"mount {m}" for m in sysmount.mounts_under(home)]
    return found


PORT = 7000

# Answers every TCP connection with the node's hostname.
ECHO_SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""

# Prints what the server at argv[1] answers; exit 1 if it cannot be reached.
# Retries "connection refused" for a moment (the server may still be
# starting), nothing else: unreachable means unreachable.
ECHO_CLIENT = f"""
import socket, sys, time
deadline = time.monotonic() + 3
while True:
    try:
        c = socket.create_connection((sys.argv[1], {PORT}), timeout=0.5)
        print(c.recv(100).decode())
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
"""


async def start_echo(shell: NodeShell) -> None:
    await shell.spawn("echo", ["python3", "-c", ECHO_SERVER])


async def reach(shell: NodeShell, address: str) -> str | None:
    """The hostname answering at ``address``, or None if unreachable."""
    r = await shell.run(["python3", "-c", ECHO_CLIENT, address], check=False, timeout_s=10)
    return r.stdout.strip() if r.returncode == 0 else None


# -- looking at the host ----------------------------------------------------


def host_read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def host_exists(path: str) -> bool:
    return Path(path).exists()


def proc_state(pid: int) -> str | None:
    """The process's state letter (R, S, Z...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def wait_dead(pid: int, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def host_pid(node: NodeLayout, pid: int) -> int | None:
    """The host's pid of the node's process ``pid`` (a pid inside the node's
    PID namespace, as pidfiles and the node's /proc have them)."""
    ns = sysmount.ns_inode(node.pid_file)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            st = (entry / "ns" / "pid").stat()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) != ns:
            continue
        nspid = next(x for x in status.splitlines() if x.startswith("NSpid:")).split()
        if int(nspid[-1]) == pid:
            return int(entry.name)
    return None


def node_layout(fleet: Fleet, node_id: str) -> NodeLayout:
    return NodeLayout(node_id, DEFAULT_NS_DIR, fleet.home / "nodes")


def parent_pid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])


def host_run(argv: list[str], *, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20, check=check
    )


def host_start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
