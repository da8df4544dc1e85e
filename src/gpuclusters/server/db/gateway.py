"""Gateway ports: each cluster's SSH and Kubernetes API ports on the public
host (docs/access.md).

A port is given once, from the operator's range, and kept for the
cluster's life (it is in the cluster's row, so a server restart changes
nothing); a deleted cluster's ports are free again. Two live clusters never
share a port: the lowest free ports are taken under the placement guard,
and partial unique indexes make a concurrent server's collision fail at
commit (the create is then tried again with a fresh view).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import ClusterType
from gpuclusters.core.errors import CapacityUnavailableError
from gpuclusters.server.db.models import Cluster


def wanted_ports(cluster: Cluster) -> list[str]:
    """The port columns this cluster should have and has not yet: every
    cluster has a Kubernetes API; Slurm clusters also a login node."""
    wanted = ["kubernetes_port"]
    if cluster.cluster_type == ClusterType.SLURM.value:
        wanted.append("ssh_port")
    return [c for c in wanted if getattr(cluster, c) is None]


async def assign_ports(
    session: AsyncSession, cluster: Cluster, *, host: str, port_range: tuple[int, int]
) -> bool:
    """Give the cluster its missing gateway ports, and the gateway's current
    host; True if anything changed."""
    changed = cluster.gateway_host != host
    cluster.gateway_host = host
    missing = wanted_ports(cluster)
    if not missing:
        return changed
    rows = await session.execute(
        select(Cluster.ssh_port, Cluster.kubernetes_port).where(
            Cluster.deleted_at.is_(None), Cluster.id != cluster.id
        )
    )
    used = {p for row in rows for p in row if p is not None}
    used |= {p for p in (cluster.ssh_port, cluster.kubernetes_port) if p is not None}
    first, last = port_range
    free = (p for p in range(first, last + 1) if p not in used)
    for column in missing:
        port = next(free, None)
        if port is None:
            raise CapacityUnavailableError(
                f"no free gateway port in {first}-{last}: every port is given to a cluster "
                "(an operator can widen GPUCLUSTERS_GATEWAY_PORTS)"
            )
        setattr(cluster, column, port)
    return True
