"""Translate database rows into the plain values providers and layers take,
so those packages never see SQLAlchemy objects."""

from __future__ import annotations

from gpuclusters.layers.base import ClusterRef, NodeRef
from gpuclusters.providers.base import NodeSpec
from gpuclusters.server.db.models import Cluster, Host, Node


def cluster_ref(cluster: Cluster) -> ClusterRef:
    return ClusterRef(
        cluster_id=cluster.id,
        name=cluster.name,
        cluster_type=cluster.cluster_type,
        gpu_type=cluster.gpu_type,
        volume_id=cluster.volume_id,
    )


def node_ref(node: Node, host: Host | None) -> NodeRef:
    return NodeRef(
        node_id=node.id,
        name=node.name,
        host=host.name if host else "",
        compute_class=node.compute_class,
    )


def node_spec(node: Node, cluster: Cluster, host: Host) -> NodeSpec:
    return NodeSpec(
        node_id=node.id,
        name=node.name,
        cluster_id=cluster.id,
        cluster_name=cluster.name,
        host=host.name,
        gpu_type=cluster.gpu_type,
        compute_class=node.compute_class,
        volume_id=cluster.volume_id,
        labels={
            "gpuclusters.io/compute-class": node.compute_class,
            "gpuclusters.io/gpu-type": cluster.gpu_type,
            "gpuclusters.io/ib-island": host.ib_island,
        },
    )
