"""Which nodes to remove when a cluster scales down.

Targeted scale-down (contract section 1): nodes the user cordoned (kubectl
cordon / scontrol drain) go first, then nodes that failed or never became
ready (they hold a host but do no work), then the newest running nodes (the
oldest have proven themselves and hold the longest-running work). Ties break
by name so the answer is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    name: str
    cordoned: bool
    running: bool
    failed: bool
    created_at: datetime


def _rank(node: NodeSnapshot) -> tuple[int, float, str]:
    if node.cordoned:
        group = 0
    elif node.failed:
        group = 1
    elif not node.running:
        group = 2
    else:
        group = 3
    return (group, -node.created_at.timestamp(), node.name)


def choose_nodes_to_remove(nodes: Sequence[NodeSnapshot], *, count: int) -> list[str]:
    """Names of the ``count`` nodes to remove first (all of them if fewer)."""
    if count <= 0:
        return []
    return [n.name for n in sorted(nodes, key=_rank)[:count]]
