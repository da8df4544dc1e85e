"""The cluster-layer contract.

A layer turns a set of nodes into a usable cluster. Like providers, every
method is idempotent: the control plane may call it again after a crash.
``drain`` is called repeatedly until it answers True (no workload left) or the
caller's deadline passes; it never blocks for long.

Layers raise ``LayerError`` for transient failures (retry later) and
``PermanentLayerError`` when retrying cannot help.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime

from gpuclusters.core.autoscale import ScaleSignals
from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import CommandResult


class LayerError(Exception):
    """A transient layer failure; retry later."""


class PermanentLayerError(LayerError):
    """A layer failure that retrying cannot fix."""


@dataclass(frozen=True, slots=True)
class UnixUser:
    """A project member's account on the cluster's nodes: the same name and
    uid everywhere, home under /home."""

    name: str
    uid: int
    # Project admins administer the cluster's orchestrator too (Slurm
    # AdminLevel=Admin: drain nodes, manage any job).
    admin: bool = False


@dataclass(frozen=True, slots=True)
class NodeRef:
    node_id: str
    name: str
    host: str
    compute_class: str
    # The scheduler's name for the node in an autoscaled cluster (its slot,
    # core/autoscale.py); None: the scheduler knows it by ``name``.
    slot: str | None = None

    @property
    def scheduler_name(self) -> str:
        return self.slot or self.name


@dataclass(frozen=True, slots=True)
class AutoscaleRef:
    """An autoscaled cluster's range (core/autoscale.py)."""

    min_gpus: int
    max_gpus: int
    idle_s: int
    slots: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GatewayRef:
    """Where users reach the cluster from their own machines
    (docs/access.md): the public host and the cluster's ports on it."""

    host: str
    ssh_port: int | None = None
    kubernetes_port: int | None = None

    @property
    def kubernetes_url(self) -> str | None:
        if self.kubernetes_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.kubernetes_port}"


@dataclass(frozen=True, slots=True)
class SshAccess:
    """Who may log in to the cluster's nodes over SSH, and the keys that
    make it so: the organization's user CA (certificates), each allowed
    member's registered keys, and the host CA that signs node host keys."""

    user_ca_public_key: str
    host_ca_private_key: str
    # Allowed accounts (principals) -> their registered public keys.
    authorized_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class RegistryRef:
    """The image registry, as a cluster's nodes use it (docs/kubernetes.md
    "Images"): its ``host:port`` (always HTTPS), the CA its certificate is
    signed by (``None``: the system's trust store), the cluster's pull
    credential, and mirrors for other registries."""

    address: str
    ca_pem: str | None
    user: str
    password: str
    mirrors: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenIssuerRef:
    """Who signs users' short-lived Kubernetes tokens (the server;
    docs/identity.md): the issuer in the tokens (``iss``), the audience of
    this cluster's tokens, where its apiserver reads the issuer's keys (the
    discovery document, on a listener nodes reach) and the CA that serves
    it (``None``: the system's trust store)."""

    issuer: str
    audience: str
    discovery_url: str
    ca_pem: str | None


@dataclass(frozen=True, slots=True)
class ClusterRef:
    cluster_id: str
    name: str
    cluster_type: str
    gpu_type: str
    volume_id: str | None
    slurm_extra_config: str = ""
    slurm_prolog: str | None = None
    slurm_epilog: str | None = None
    users: tuple[UnixUser, ...] = ()
    # The cluster's nodes that have joined (or are joining), for layers that
    # must touch every node when configuration changes.
    nodes: tuple[NodeRef, ...] = ()
    gateway: GatewayRef | None = None
    # None where SSH is not set up (fake provider, tests of other layers).
    ssh: SshAccess | None = None
    # None where the server runs no registry.
    registry: RegistryRef | None = None
    # None where the server signs no Kubernetes tokens (no TLS, no listener
    # nodes reach): users' kubeconfigs then carry client certificates.
    token_issuer: TokenIssuerRef | None = None
    # The project's host id block (its nodes' user namespaces); None where
    # the caller did not load it (the provider then uses the cluster's).
    host_ids: IdBlock | None = None
    # None: a fixed-size cluster.
    autoscale: AutoscaleRef | None = None


class ClusterLayer(ABC):
    @abstractmethod
    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        """Start (or confirm) the cluster's control plane; True once it is up."""

    @abstractmethod
    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        """Register the node with the orchestrator; True once it is schedulable."""

    @abstractmethod
    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        """Stop new work landing on the node."""

    @abstractmethod
    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        """Ask workloads on the node to leave; True when none is left."""

    @abstractmethod
    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        """Whether a user or admin cordoned/drained the node (targeted scale-down)."""

    @abstractmethod
    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        """Forget the node; a node that is not registered is not an error."""

    @abstractmethod
    async def delete(self, cluster: ClusterRef) -> None:
        """Stop the control plane and forget the cluster; idempotent."""

    def waiting_for_builds(self) -> str | None:
        """Why no control plane can start yet: a part it runs is still being
        built by scripts/setup's background builder (the cluster waits in
        ``waiting_for_build`` with this message), or None. Cheap: a file read,
        asked at every pass while a cluster waits."""
        return None

    async def scale_signals(self, cluster: ClusterRef) -> ScaleSignals | None:
        """What the scheduler of an autoscaled cluster asks for now
        (core/autoscale.py); None where the layer does not autoscale."""
        return None

    async def apply_config(self, cluster: ClusterRef) -> None:  # noqa: B027 (optional)
        """Apply the cluster's user-settable configuration to the running
        cluster (e.g. slurm.conf extras, prolog/epilog, then reconfigure).
        Idempotent. Layers without such settings keep this no-op."""

    async def uncordon(self, cluster: ClusterRef, node: NodeRef) -> None:  # noqa: B027
        """Let work land on the node again after *our* cordon (a repair that
        finished or was cancelled); a cordon or drain a user set stays."""

    async def run_exclusive(
        self, cluster: ClusterRef, node: NodeRef, argv: list[str], *, timeout_s: float
    ) -> CommandResult | None:
        """Run ``argv`` on the node as the orchestrator's own exclusive work
        (so it waits for users' work to leave and nothing lands beside it),
        e.g. an active health check. None where the layer cannot; the
        caller then runs it through the node's shell."""
        return None

    # -- preemption (optional; defaults fit layers without workloads) ---------

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        """How many workloads (jobs, pods) run on the node now; used to pick
        the preemptible node whose preemption costs least."""
        return 0

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        """T+0 of the preemption protocol: cordon with ``reason``, tell the
        orchestrator's users (e.g. a Kubernetes Warning event), and send the
        workloads SIGTERM with their grace capped at ``deadline``. Called
        again after a crash: must not lose track of the workloads that ran
        at T+0."""
        await self.cordon(cluster, node, reason=reason)

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        """True once no workload is left on the node and what ran there at
        T+0 has been handed back to the orchestrator to run elsewhere
        (Slurm: requeued). From ``deadline`` on, what is left is stopped
        and handed back the same way. Never blocks for long."""
        return await self.drain(cluster, node, reason=reason, deadline=deadline)

    @abstractmethod
    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        """A kubeconfig for this user (``project``: the cluster's project's
        name, which a kubeconfig that asks for tokens names)."""

    async def gateway_targets(self, cluster: ClusterRef) -> dict[str, tuple[str, int]]:
        """Where the gateway's ports lead, by name ("ssh": the login node's
        sshd, "kubernetes": the apiserver), as ``(address, port)`` on the
        cluster's network; empty where nothing is reachable."""
        return {}

    async def sync_access(self, cluster: ClusterRef) -> None:  # noqa: B027 (optional)
        """Bring who may log in over SSH (``cluster.ssh``) to every node
        that runs sshd; called by the access sync whenever it changed."""
