"""Everything the running server holds: settings, database, provider, layers,
volume store, hints and controllers. Built once by the app lifespan and
handed to routers (as a dependency) and controllers (at construction)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gpuclusters.core.enums import ClusterType
from gpuclusters.core.nodeshell import NodeAccess
from gpuclusters.layers.bare.layer import BareLayer
from gpuclusters.layers.base import ClusterLayer
from gpuclusters.layers.noop.layer import NoopLayer
from gpuclusters.layers.slurm.layer import SlurmLayer
from gpuclusters.providers.base import NodeProvider
from gpuclusters.providers.volumes import VolumeStore
from gpuclusters.server.controllers.hints import Hints
from gpuclusters.server.settings import Settings


@dataclass
class Runtime:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    provider: NodeProvider
    volumes: VolumeStore
    hints: Hints = field(default_factory=Hints)
    layers: dict[ClusterType, ClusterLayer] = field(default_factory=dict)
    # Held while a request places nodes on hosts (see services.allocation).
    placement_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Running nodes whose instance this process has checked since it started.
    # Until the node reconciler has checked a node, a missing instance means
    # "lost while we were down; rebuild", not "failed while we watched".
    verified_nodes: set[str] = field(default_factory=set)

    @property
    def node_access(self) -> NodeAccess | None:
        """Shells on nodes, where the provider offers them (netns does)."""
        return self.provider if isinstance(self.provider, NodeAccess) else None

    def layer_for(self, cluster_type: str) -> ClusterLayer:
        return self.layers[ClusterType(cluster_type)]


def layers_for_provider(provider: NodeProvider) -> dict[ClusterType, ClusterLayer]:
    """Which orchestrator layers run over this provider's nodes. Providers
    with shells on their nodes (netns) get real Slurm; Kubernetes clusters get
    bare nodes with accounts until the Kubernetes layer lands. Fake nodes are
    bookkeeping only, so they get the no-op layer for every type."""
    if isinstance(provider, NodeAccess):
        return {
            ClusterType.KUBERNETES: BareLayer(provider),
            ClusterType.SLURM: SlurmLayer(provider),
        }
    noop = NoopLayer()
    return {ClusterType.KUBERNETES: noop, ClusterType.SLURM: noop}
