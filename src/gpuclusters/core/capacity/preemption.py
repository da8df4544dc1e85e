"""Preemptible capacity as pure functions: which preemptible nodes give up
their hosts when standard demand needs them, and how many preemptible nodes
a cluster may still add.

Spare capacity is every host that no standard node holds. Preemptible nodes
fill it toward each cluster's target and give it back when standard demand
(a create, a scale-up, an admin's reclaim) needs it.

Victim choice, in order (the first difference decides):
1. Nodes already being preempted whose host nobody awaits: they are leaving
   anyway, so taking their host disrupts nothing more.
2. The least running work: a node with fewer running jobs or pods loses
   less when it goes (booting nodes run nothing).
3. Nodes in an InfiniBand island the requesting cluster already uses, so
   the new standard node sits next to its peers.
4. The newest node: the oldest have done the most work and are likeliest to
   hold long-running jobs near a checkpoint.
5. The node name, so the answer is deterministic.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from gpuclusters.core.enums import GPUS_PER_NODE


@dataclass(frozen=True, slots=True)
class PreemptibleNode:
    """What victim choice needs to know about one preemptible node."""

    name: str
    host: str
    gpu_type: str
    region: str
    ib_island: str
    running_work: int
    created_at: datetime
    # Already marked for preemption, with no standard node awaiting its host.
    leaving: bool = False


def _rank(node: PreemptibleNode, used_islands: Collection[str]) -> tuple[int, int, int, float, str]:
    return (
        0 if node.leaving else 1,
        node.running_work,
        0 if node.ib_island in used_islands else 1,
        -node.created_at.timestamp(),
        node.name,
    )


def choose_victims(
    nodes: Sequence[PreemptibleNode],
    *,
    count: int,
    gpu_type: str,
    region: str,
    used_islands: Collection[str] = (),
) -> list[PreemptibleNode]:
    """Up to ``count`` preemptible nodes whose hosts fit a standard node of
    ``gpu_type`` in ``region``, best victims first (see module docstring).
    Fewer than ``count`` when not enough are there; the caller decides."""
    if count <= 0:
        return []
    fitting = [n for n in nodes if n.gpu_type == gpu_type and n.region == region]
    return sorted(fitting, key=lambda n: _rank(n, used_islands))[:count]


def preemptible_deficit(*, target_gpus: int, live_nodes: int) -> int:
    """Nodes a cluster still wants for its preemptible target (never negative)."""
    return max(0, target_gpus // GPUS_PER_NODE - live_nodes)


def preemptible_surplus(*, target_gpus: int, live_nodes: int) -> int:
    """Nodes above the target (after the user lowered it)."""
    return max(0, live_nodes - target_gpus // GPUS_PER_NODE)
