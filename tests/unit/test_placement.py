"""Placement of nodes on hosts (pure)."""

from __future__ import annotations

import pytest

from gpuclusters.core.capacity.placement import (
    HostSlot,
    describe_counts,
    describe_free,
    place_nodes,
    plan_islands,
)
from gpuclusters.core.errors import CapacityUnavailableError


def fleet(
    spec: dict[str, int], *, busy: frozenset[str] | set[str] = frozenset(), gpu: str = "H100_SXM"
) -> list[HostSlot]:
    hosts = []
    for island, n in spec.items():
        for i in range(1, n + 1):
            name = f"{island}-{i:02d}"
            hosts.append(HostSlot(name, gpu, "r1", island, free=name not in busy))
    return hosts


def place(hosts: list[HostSlot], count: int, used: tuple[str, ...] = ()) -> list[str]:
    return [
        h.name
        for h in place_nodes(
            hosts, count=count, gpu_type="H100_SXM", region="r1", used_islands=used
        )
    ]


def test_fits_in_smallest_island_that_holds_everything() -> None:
    hosts = fleet({"a": 8, "b": 3})
    assert place(hosts, 2) == ["b-01", "b-02"]
    assert place(hosts, 4) == ["a-01", "a-02", "a-03", "a-04"]


def test_spills_over_largest_island_first() -> None:
    hosts = fleet({"a": 2, "b": 3, "c": 1})
    got = place(hosts, 5)
    assert got == ["b-01", "b-02", "b-03", "a-01", "a-02"]


def test_scale_up_prefers_islands_already_used() -> None:
    hosts = fleet({"a": 8, "b": 8}, busy={"b-01"})
    assert place(hosts, 2, used=("b",)) == ["b-02", "b-03"]


def test_busy_and_wrong_type_hosts_are_never_chosen() -> None:
    hosts = fleet({"a": 2}, busy={"a-01"}) + fleet({"x": 4}, gpu="H200_SXM")
    assert place(hosts, 1) == ["a-02"]
    with pytest.raises(CapacityUnavailableError) as err:
        place(hosts, 2)
    assert "need 2" in err.value.message and "1 free" in err.value.message
    assert "4 x H200_SXM in r1" in err.value.message
    assert err.value.field == "num_gpus"


def test_zero_is_nothing() -> None:
    assert place(fleet({"a": 1}), 0) == []


def test_describe_free_when_nothing_free() -> None:
    assert describe_free(fleet({"a": 1}, busy={"a-01"})) == "no hosts are free"


@pytest.mark.parametrize("count", range(1, 12))
def test_never_duplicates_and_respects_count(count: int) -> None:
    hosts = fleet({"a": 5, "b": 4, "c": 2}, busy={"a-03", "b-01"})
    got = place(hosts, count) if count <= 9 else None
    if got is None:
        with pytest.raises(CapacityUnavailableError):
            place(hosts, count)
        return
    assert len(got) == count == len(set(got))
    assert not {"a-03", "b-01"} & set(got)


def test_island_plan_matches_host_placement() -> None:
    # The SQL placement (db/allocation.py) plans with island counts; the
    # plan must be the one place_nodes makes from the hosts themselves.
    islands = {"ib-a": 3, "ib-b": 5, "ib-c": 2}
    hosts = fleet(islands)
    for count in range(0, 11):
        for used in ((), ("ib-c",), ("ib-a", "ib-b", "ib-b")):
            plan = plan_islands(islands, count, used)
            placed = place_nodes(
                hosts, count=count, gpu_type="H100_SXM", region="r1", used_islands=used
            )
            by_island: dict[str, int] = {}
            for h in placed:
                by_island[h.ib_island] = by_island.get(h.ib_island, 0) + 1
            assert dict(plan) == by_island, (count, used)
            assert sum(n for _, n in plan) == count


def test_island_plan_places_what_is_free_when_short() -> None:
    assert plan_islands({"ib-a": 1, "ib-b": 0}, 3) == [("ib-a", 1)]
    assert plan_islands({}, 2) == []


def test_describe_counts_names_what_is_free() -> None:
    assert describe_counts({("H100_SXM", "r1"): 2, ("A100", "r2"): 0}) == (
        "free now: 2 x H100_SXM in r1"
    )
    assert describe_counts({}) == "no hosts are free"
