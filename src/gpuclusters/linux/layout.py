"""Names and paths of one namespace node, derived from its id alone.

Everything that identifies a node on the host is a pure function of the node
id and two roots, so that the provider can always find (and delete) what a
crashed predecessor made, even from a half-written state file:

==========================  ===============================================
netns                        ``/run/netns/gpc-<id[:12]>`` (``ip netns``)
host veth                    ``gpcv<id[:8]>`` (node side is ``eth0``)
user, cgroup ns              ``<ns_dir>/<id>.{user,cgroup}`` (user
                             namespace mode: linux/userns.py); the user
                             namespace's map is in ``<id>.userids``
mount, UTS, IPC, PID ns     ``<ns_dir>/<id>.{mnt,uts,ipc,pid}``; the PID
                             namespace's init (the node's PID 1) is recorded
                             in ``<home>/nodes/<id>/init`` (host pid, start)
node directory               ``<home>/nodes/<id>/``: ``root/`` (the node's
                             ``/``), ``upper/{etc,var}`` + ``work/{etc,var}``
                             (overlay layers), ``tmp/``, ``scratch/``,
                             ``state/<name>`` (bound rw at the paths in
                             ``STATE_DIRS``: container and kubelet state on a
                             real filesystem, since overlayfs cannot nest)
/var's lower layer           ``<home>/node-base/var`` (a skeleton, shared)
cgroups                      ``/sys/fs/cgroup/<controller>/gpc-<id[:12]>``:
                             the node's kubelet cgroup root (containers)
cluster bridge               ``gpcb<cluster_id[:8]>``, ``10.231.<i>.1/24``
==========================  ===============================================

Interface names are limited to 15 bytes (IFNAMSIZ), which is why only a
prefix of each id is used; the provider refuses ids whose prefixes collide.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")
DEFAULT_NS_DIR = Path("/run/gpuclusters/ns")
SUBNET_POOL = ipaddress.IPv4Network("10.231.0.0/16")
# The whole environment of commands and daemons run in nodes (plus what the
# caller adds): nothing of the server's environment leaks into a node.
NODE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
# Per-node directories bound read-write over these paths inside the node:
# containerd's overlayfs snapshots cannot live on the node's /var overlay
# (overlayfs refuses an upper dir on overlayfs), and kubelet's pod volumes
# belong beside them. Wiped on reprovision, like the rest of the node's disk.
STATE_DIRS = {"containerd": "/var/lib/containerd", "kubelet": "/var/lib/kubelet"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
FIRST_NODE_HOST = 10  # .1 is the host's address on the bridge; .2-.9 stay free
LAST_NODE_HOST = 254

_ID_RE = re.compile(r"^[a-z0-9]{12,64}$")
# RFC 1123 label rules, dots allowed; what sethostname() and every daemon accept.
_HOSTNAME_RE = re.compile(r"^(?=.{1,63}$)[a-zA-Z0-9]([a-zA-Z0-9.-]*[a-zA-Z0-9])?$")


class LayoutError(ValueError):
    """An id or name that cannot be turned into host objects."""


def check_id(value: str, what: str) -> str:
    if not _ID_RE.match(value):
        raise LayoutError(f"{what} {value!r}: expected 12-64 lowercase letters and digits")
    return value


def check_hostname(value: str) -> str:
    if not _HOSTNAME_RE.match(value):
        raise LayoutError(f"{value!r} is not a valid hostname (letters, digits, '-', '.')")
    return value


def bridge_name(cluster_id: str) -> str:
    return "gpcb" + check_id(cluster_id, "cluster id")[:8]


def subnet(index: int) -> ipaddress.IPv4Network:
    """The cluster network with this index: ``10.231.<index>.0/24``."""
    if not 0 <= index <= 255:
        raise LayoutError(f"network index {index} outside 0-255")
    return ipaddress.IPv4Network((int(SUBNET_POOL.network_address) + (index << 8), 24))


def gateway(index: int) -> str:
    return str(subnet(index).network_address + 1)


def node_address(index: int, host_part: int) -> str:
    if not FIRST_NODE_HOST <= host_part <= LAST_NODE_HOST:
        raise LayoutError(f"host part {host_part} outside {FIRST_NODE_HOST}-{LAST_NODE_HOST}")
    return str(subnet(index).network_address + host_part)


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where one node's pieces live on the host."""

    node_id: str
    ns_dir: Path
    nodes_dir: Path
    # Whether the node runs in its own user namespace (linux/userns.py):
    # then its namespaces are entered through it, and it has a cgroup
    # namespace too.
    userns: bool = False

    def __post_init__(self) -> None:
        check_id(self.node_id, "node id")

    @property
    def netns(self) -> str:
        return "gpc-" + self.node_id[:12]

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def veth(self) -> str:
        return "gpcv" + self.node_id[:8]

    @property
    def mnt_file(self) -> Path:
        return self.ns_dir / f"{self.node_id}.mnt"

    @property
    def uts_file(self) -> Path:
        return self.ns_dir / f"{self.node_id}.uts"

    @property
    def ipc_file(self) -> Path:
        return self.ns_dir / f"{self.node_id}.ipc"

    @property
    def pid_file(self) -> Path:
        return self.ns_dir / f"{self.node_id}.pid"

    @property
    def user_file(self) -> Path:
        """The node's user namespace: pinned for the node's life, like the
        netns it owns (a power-off keeps it)."""
        return self.ns_dir / f"{self.node_id}.user"

    @property
    def cgroup_file(self) -> Path:
        return self.ns_dir / f"{self.node_id}.cgroup"

    @property
    def ns_files(self) -> tuple[Path, ...]:
        """The namespaces pinned at boot besides the netns (and the user
        namespace): a power-off drops them."""
        files = (self.mnt_file, self.uts_file, self.ipc_file, self.pid_file)
        return (*files, self.cgroup_file) if self.userns else files

    @property
    def dir(self) -> Path:
        return self.nodes_dir / self.node_id

    @property
    def init_file(self) -> Path:
        """``<host pid> <start time>`` of the node's init (its PID 1)."""
        return self.dir / "init"

    @property
    def root(self) -> Path:
        return self.dir / "root"

    def upper(self, name: str) -> Path:
        return self.dir / "upper" / name

    def work(self, name: str) -> Path:
        return self.dir / "work" / name

    @property
    def var_base(self) -> Path:
        """The lower layer of every node's /var (``linux/nodebase.py``):
        shared by the nodes of this home, never the host's /var."""
        return self.nodes_dir.parent / "node-base" / "var"

    @property
    def tmp(self) -> Path:
        return self.dir / "tmp"

    @property
    def scratch(self) -> Path:
        return self.dir / "scratch"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def disks(self) -> tuple[Path, ...]:
        """The node's own directories on the host: its root, its /etc and
        /var layers, /tmp, /scratch and state. A reprovision removes them; a
        node in a user namespace owns them (shifted into its id block)."""
        upper, work = self.dir / "upper", self.dir / "work"
        return (self.root, upper, work, self.tmp, self.scratch, self.state)

    @property
    def ids_file(self) -> Path:
        """The first host id the node's disks were shifted to (linux/machine.py)."""
        return self.dir / "ids"

    @property
    def cgroup_name(self) -> str:
        """The node's cgroup (below each v1 controller's root): the cgroup
        root its kubelet puts pods under, so several kubelets share one kernel
        without sharing cgroups, and power-off finds every container."""
        return "gpc-" + self.node_id[:12]

    def nsenter_args(self) -> list[str]:
        """The ``nsenter`` options that put a command inside this node (as
        the node's root, when it has a user namespace)."""
        user = [f"--user={self.user_file}", f"--cgroup={self.cgroup_file}"] if self.userns else []
        return [
            *user,
            f"--net={self.netns_path}",
            f"--mount={self.mnt_file}",
            f"--uts={self.uts_file}",
            f"--ipc={self.ipc_file}",
            # Entering a PID namespace makes nsenter fork: the command is a
            # process of the node (its parent, the node's init, once
            # nsenter exits), seeing only the node's processes.
            f"--pid={self.pid_file}",
        ]
