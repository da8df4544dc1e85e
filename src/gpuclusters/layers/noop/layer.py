"""The no-op layer used with the fake provider.

There is no orchestrator behind fake nodes, so every step succeeds at once
and nothing is ever cordoned by users. ``credentials`` refuses: handing out a
kubeconfig for an API server that does not exist would be a lie.
"""

from __future__ import annotations

from datetime import datetime

from gpuclusters.core.errors import InvalidStateError
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef


class NoopLayer(ClusterLayer):
    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        return True

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        return True

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        return None

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        return True

    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        return False

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        return None

    async def delete(self, cluster: ClusterRef) -> None:
        return None

    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        raise InvalidStateError(
            f"cluster {cluster.name} has no Kubernetes control plane on this provider "
            "(fake nodes are bookkeeping only; use the netns provider for real clusters)"
        )
