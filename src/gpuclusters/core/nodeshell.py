"""How cluster layers reach into nodes, whatever the nodes are made of.

Layers (Slurm, Kubernetes) must configure files, start daemons and run
commands *inside* nodes, but must not know whether a node is a set of Linux
namespaces (the embedded ``netns`` provider), a VM reached over SSH, or
something else. Providers that can do this implement ``NodeAccess``; the
server hands it to the layers. These are protocols only: no I/O here.

Paths given to a ``NodeShell`` are paths *inside* the node. Every method is
idempotent where that makes sense (``spawn`` of a running daemon, ``stop``
of a stopped one, ``write_file`` of identical content) because controllers
repeat steps after a crash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpuclusters.core.idblocks import IdBlock


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class NodeCommandError(Exception):
    """A command inside a node failed (non-zero exit with ``check=True``)."""

    def __init__(self, node: str, argv: Sequence[str], result: CommandResult) -> None:
        self.node = node
        self.argv = list(argv)
        self.result = result
        tail = (result.stderr or result.stdout).strip()[-500:]
        super().__init__(f"{node}: {' '.join(argv)} exited {result.returncode}: {tail}")


class NodeShell(Protocol):
    """One node, seen from the control plane."""

    @property
    def hostname(self) -> str:
        """The node's own hostname (what ``hostname`` prints inside it)."""

    @property
    def address(self) -> str:
        """The node's IP address on its cluster's network."""

    @property
    def python(self) -> str:
        """The Python interpreter with gpuclusters installed that the node
        sees (its host's: the server's on its own machine, the host agent's
        on a GPU host), for the project's programs run in nodes."""

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        """Run a command inside the node (as root, or as ``user``) and wait.
        Raises ``NodeCommandError`` on a non-zero exit when ``check``."""

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        """Start a long-lived daemon inside the node, detached from the server
        (it survives a server restart), with output appended to
        ``/var/log/gpuclusters/<name>.log`` inside the node. ``argv`` must run
        in the foreground. If a daemon called ``name`` is already running,
        do nothing."""

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the daemon ``name``, SIGKILL after ``timeout_s``; a daemon
        that is not running is not an error."""

    async def is_running(self, name: str) -> bool:
        """Whether the daemon ``name`` is alive."""

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        """Write a file inside the node atomically, creating parent
        directories; return False (and write nothing) if the content and mode
        are already the same. ``owner`` is a user name known inside the node."""

    async def read_file(self, path: str) -> bytes | None:
        """A file's content inside the node, or None if it does not exist."""

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        """A host command line that runs ``argv`` inside the node with the
        caller's terminal attached (for ``gpuclusters clusters ssh``)."""


@dataclass(frozen=True, slots=True)
class GatewayTarget:
    """A gateway port: TCP ``public_port`` on the public host forwarded to
    ``address:port`` on the cluster's network."""

    public_port: int
    address: str
    port: int


@runtime_checkable
class NodeAccess(Protocol):
    """What a provider offers layers: shells on nodes, and service nodes
    (a cluster's controller and login machines, which hold no GPU host)."""

    async def shell(self, node_id: str) -> NodeShell:
        """A shell on a GPU node the provider created."""

    async def ensure_service_node(
        self,
        *,
        cluster_id: str,
        cluster_name: str,
        role: str,
        volume_id: str | None,
        host_ids: IdBlock | None = None,
    ) -> NodeShell:
        """Create (or find) the cluster's service node for ``role``
        (e.g. "controller", "login") on the cluster's network; idempotent.
        ``host_ids``: the project's id block, for a provider that runs nodes
        in user namespaces."""

    async def delete_service_nodes(self, *, cluster_id: str) -> None:
        """Remove all service nodes of the cluster; idempotent."""

    async def ensure_gateway(
        self, *, cluster_id: str, egress: bool, forwards: Mapping[str, GatewayTarget]
    ) -> None:
        """Make the cluster reachable on its gateway ports (by name, e.g.
        "ssh", "kubernetes") and let its nodes reach outside networks or
        not; idempotent. Called once the cluster's network exists."""
