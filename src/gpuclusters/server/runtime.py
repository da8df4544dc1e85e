"""Everything the running server holds: settings, database, provider, layers,
volume store, hints and controllers. Built once by the app lifespan and
handed to routers (as a dependency) and controllers (at construction)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gpuclusters.core.enums import ClusterType
from gpuclusters.core.nodeshell import NodeAccess
from gpuclusters.core.telemetry import TelemetryHistory
from gpuclusters.layers.base import ClusterLayer
from gpuclusters.layers.combined import SlurmAndKubernetesLayer
from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.layers.kubernetes.layer import KubernetesLayer
from gpuclusters.layers.noop.layer import NoopLayer
from gpuclusters.layers.slurm.layer import SlurmLayer
from gpuclusters.providers.base import NodeProvider
from gpuclusters.providers.volumes import VolumeStore
from gpuclusters.server.controllers.hints import Hints
from gpuclusters.server.metrics_db import MetricsDb
from gpuclusters.server.registry_daemon import RegistryRuntime
from gpuclusters.server.security.cluster_tokens import TokenIssuer
from gpuclusters.server.security.oidc import OidcClient
from gpuclusters.server.settings import Settings


@dataclass
class Runtime:
    settings: Settings
    engine: AsyncEngine
    # Controllers, housekeeping and start-up work on ``sessionmaker``.
    sessionmaker: async_sessionmaker[AsyncSession]
    provider: NodeProvider
    volumes: VolumeStore
    # API requests get connections from a pool of their own, so a burst of
    # controller steps can never make a request wait for a connection (on
    # PostgreSQL a shared pool made creates wait up to its 30 s timeout).
    api_engine: AsyncEngine | None = None
    api_sessionmaker: async_sessionmaker[AsyncSession] | None = None
    hints: Hints = field(default_factory=Hints)
    layers: dict[ClusterType, ClusterLayer] = field(default_factory=dict)
    # Held while a request places nodes on hosts (see services.allocation).
    placement_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Running nodes this process has not yet checked since it started: the
    # node reconciler's first pass takes them (``nodes_snapshot_taken``) and
    # checks each once. Until it has, a missing instance means "lost while
    # we were down; rebuild", not "failed while we watched".
    nodes_to_verify: set[str] = field(default_factory=set)
    nodes_snapshot_taken: bool = False
    # The image registry, where this server runs one (settings.registry_enabled).
    registry: RegistryRuntime | None = None
    # The metrics database, where this server runs one (settings.metrics_db_enabled),
    # and the token it scrapes /metrics and the node targets with.
    metrics_db: MetricsDb | None = None
    # The identity provider's client, where single sign-on is configured.
    oidc: OidcClient | None = None
    # The signer of users' Kubernetes tokens (over TLS only: apiservers
    # accept an https issuer only).
    token_issuer: TokenIssuer | None = None
    metrics_scrape_token: str | None = None
    # GPU samples from the node agents' heartbeats, for the console's charts.
    telemetry: TelemetryHistory = field(default_factory=TelemetryHistory)

    @property
    def request_sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        """Where API requests get their sessions (their own pool if set)."""
        return self.api_sessionmaker or self.sessionmaker

    @property
    def node_access(self) -> NodeAccess | None:
        """Shells on nodes, where the provider offers them (netns does)."""
        return self.provider if isinstance(self.provider, NodeAccess) else None

    def layer_for(self, cluster_type: str) -> ClusterLayer:
        return self.layers[ClusterType(cluster_type)]


def layers_for_provider(
    provider: NodeProvider, *, k8s_bin_dir: Path | None = None
) -> dict[ClusterType, ClusterLayer]:
    """Which orchestrator layers run over this provider's nodes. Providers
    with shells on their nodes (netns) get real Kubernetes on every cluster,
    with Slurm on top for Slurm clusters. Fake nodes are bookkeeping only, so
    they get the no-op layer for every type."""
    if isinstance(provider, NodeAccess):
        kubernetes = KubernetesLayer(provider, bin_dir=k8s_bin_dir or DEFAULT_BIN_DIR)
        return {
            ClusterType.KUBERNETES: kubernetes,
            ClusterType.SLURM: SlurmAndKubernetesLayer(SlurmLayer(provider), kubernetes),
        }
    noop = NoopLayer()
    return {ClusterType.KUBERNETES: noop, ClusterType.SLURM: noop}
