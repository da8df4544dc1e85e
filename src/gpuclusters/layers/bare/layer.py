"""The bare layer: nodes with accounts and nothing on top.

Used for Kubernetes-type clusters on a provider with shell access until the
Kubernetes layer lands: the nodes are real (namespaces, /scratch, the shared
volume, GPU devices, the agent) and project members have their accounts on
them, but there is no orchestrator yet, so there is nothing to cordon,
drain or hand out credentials for: those steps are the no-op layer's.
"""

from __future__ import annotations

from gpuclusters.core.errors import InvalidStateError
from gpuclusters.core.nodeshell import NodeAccess
from gpuclusters.layers.accounts import ensure_accounts
from gpuclusters.layers.base import ClusterRef, NodeRef
from gpuclusters.layers.noop.layer import NoopLayer


class BareLayer(NoopLayer):
    def __init__(self, access: NodeAccess) -> None:
        self.access = access

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        shell = await self.access.shell(node.node_id)
        await ensure_accounts(shell, cluster.users)
        return True

    async def delete(self, cluster: ClusterRef) -> None:
        await self.access.delete_service_nodes(cluster_id=cluster.cluster_id)

    async def credentials(self, cluster: ClusterRef, *, user: str, admin: bool) -> str:
        raise InvalidStateError(f"cluster {cluster.name} has no Kubernetes API yet")
