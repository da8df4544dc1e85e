"""Choice of nodes to remove on scale-down (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuclusters.core.capacity.scale_down import NodeSnapshot, choose_nodes_to_remove

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node(
    name: str, age_h: int, *, cordoned: bool = False, running: bool = True, failed: bool = False
) -> NodeSnapshot:
    return NodeSnapshot(name, cordoned, running, failed, T0 - timedelta(hours=age_h))


def test_cordoned_first_then_failed_then_booting_then_newest() -> None:
    nodes = [
        node("old", 10),
        node("new", 1),
        node("cordoned-old", 20, cordoned=True),
        node("failed", 5, running=False, failed=True),
        node("booting", 0, running=False),
    ]
    assert choose_nodes_to_remove(nodes, count=5) == [
        "cordoned-old",
        "failed",
        "booting",
        "new",
        "old",
    ]
    assert choose_nodes_to_remove(nodes, count=1) == ["cordoned-old"]


def test_count_bounds() -> None:
    nodes = [node("a", 1), node("b", 2)]
    assert choose_nodes_to_remove(nodes, count=0) == []
    assert choose_nodes_to_remove(nodes, count=5) == ["a", "b"]
