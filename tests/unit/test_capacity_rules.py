"""Pure capacity rules: preemption victims, pool targets, reservations, pricing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpuclusters.core.capacity.preemption import (
    PreemptibleNode,
    choose_victims,
    preemptible_deficit,
    preemptible_surplus,
)
from gpuclusters.core.capacity.reservations import Window, held_back, overbooked, split
from gpuclusters.core.pricing import Interval, clipped_hours, gpu_hour_rate, summarize

T = datetime(2026, 12, 1, tzinfo=UTC)


def pnode(
    name: str, *, work: int = 0, island: str = "ib-a", age_s: int = 0, **kw: object
) -> PreemptibleNode:
    return PreemptibleNode(
        name=name,
        host=f"host-{name}",
        gpu_type=str(kw.get("gpu_type", "H100_SXM")),
        region="local-1",
        ib_island=island,
        running_work=work,
        created_at=T - timedelta(seconds=age_s),
        leaving=bool(kw.get("leaving", False)),
    )


def test_victims_least_work_first_then_leaving_island_and_newest() -> None:
    nodes = [
        pnode("busy", work=3),
        pnode("idle-old", age_s=100),
        pnode("idle-new", age_s=1),
        pnode("idle-other-island", island="ib-b"),
        pnode("leaving", work=5, leaving=True),
        pnode("h200", gpu_type="H200_SXM"),
    ]
    order = choose_victims(nodes, count=6, gpu_type="H100_SXM", region="local-1",
                           used_islands={"ib-a"})  # fmt: skip
    assert [n.name for n in order] == [
        "leaving",
        "idle-new",
        "idle-old",
        "idle-other-island",
        "busy",
    ]
    assert choose_victims(nodes, count=0, gpu_type="H100_SXM", region="local-1") == []
    assert choose_victims(nodes, count=1, gpu_type="B200_SXM", region="local-1") == []


def test_pool_deficit_and_surplus() -> None:
    assert preemptible_deficit(target_gpus=16, live_nodes=1) == 1
    assert preemptible_deficit(target_gpus=16, live_nodes=3) == 0
    assert preemptible_surplus(target_gpus=8, live_nodes=3) == 2
    assert preemptible_surplus(target_gpus=24, live_nodes=3) == 0


def window(project: str, gpus: int, start_h: float, end_h: float, kind: str = "reserved") -> Window:
    return Window(
        project=project,
        kind=kind,
        gpu_type="H100_SXM",
        region="local-1",
        num_gpus=gpus,
        start=T + timedelta(hours=start_h),
        end=T + timedelta(hours=end_h),
    )


def test_held_back_counts_other_projects_unused_active_reservations() -> None:
    ws = [window("a", 16, 0, 10), window("b", 8, 0, 10), window("c", 8, 5, 10)]
    at = T + timedelta(hours=1)

    def held(requester: str, used: dict[str, int]) -> int:
        return held_back(
            ws, requester=requester, gpu_type="H100_SXM", region="local-1",
            standard_nodes=used, at=at,
        )  # fmt: skip

    assert held("x", {}) == 3
    assert held("a", {}) == 1
    # a already runs one standard node there; b more than its reservation.
    assert held("x", {"a": 1, "b": 4}) == 1


def test_split_fills_reserved_then_pool_in_creation_order() -> None:
    parts = split([("c1", 16), ("c2", 16), ("c3", 8)], reserved=24, pool=8)
    assert [(p.reserved, p.pool, p.on_demand) for p in parts.values()] == [
        (16, 0, 0),
        (8, 8, 0),
        (0, 0, 8),
    ]


def test_overbooked_checks_every_start_inside_the_new_window() -> None:
    ws = [window("a", 16, 0, 5), window("b", 16, 4, 8)]
    assert overbooked(ws, window("c", 8, 6, 9), hosts=4) is None  # only b active then
    assert overbooked(ws, window("c", 16, 1, 6), hosts=4) == 0  # at 4h: a+b use all 4
    assert overbooked(ws, window("c", 16, 0, 2), hosts=4) is None
    assert overbooked([], window("c", 40, 0, 1), hosts=4) == 4


def test_rates_configured_alias_and_discounts() -> None:
    discounts = {"on_demand": 0.0, "reserved": 0.35, "pool": 0.2, "preemptible": 0.6}
    assert gpu_hour_rate("H100_SXM", "on_demand", rates={}, discounts=discounts) == 2.99
    assert gpu_hour_rate("H100_SXM", "preemptible", rates={}, discounts=discounts) == (
        pytest.approx(2.99 * 0.4)
    )
    rates = {"H100_SXM": {"standard": 2.0, "pool": 1.5}}
    assert gpu_hour_rate("H100_SXM", "reserved", rates=rates, discounts=discounts) == (
        pytest.approx(1.3)
    )
    assert gpu_hour_rate("H100_SXM", "pool", rates=rates, discounts=discounts) == 1.5


def interval(start_h: float, end_h: float | None, *, billing: str = "on_demand") -> Interval:
    return Interval(
        cluster="c",
        compute_class="preemptible" if billing == "preemptible" else "standard",
        billing=billing,
        gpu_type="H100_SXM",
        num_gpus=8,
        started_at=T + timedelta(hours=start_h),
        ended_at=None if end_h is None else T + timedelta(hours=end_h),
    )


def test_usage_is_clipped_to_the_window_and_open_records_run_to_until() -> None:
    since, until = T + timedelta(hours=1), T + timedelta(hours=3)
    assert clipped_hours(interval(0, 2), since=since, until=until) == 1
    assert clipped_hours(interval(2, None), since=since, until=until) == 1
    assert clipped_hours(interval(4, 5), since=since, until=until) == 0
    sums = summarize(
        [interval(0, 2), interval(2, None), interval(0, 3, billing="preemptible")],
        since=since,
        until=until,
        rates={"H100_SXM": {"on_demand": 2.0}},
        discounts={"preemptible": 0.5},
    )
    by = {s.billing: s for s in sums}
    assert by["on_demand"].nodes == 2 and by["on_demand"].gpu_hours == 16
    assert by["on_demand"].cost == 32
    assert by["preemptible"].gpu_hours == 16 and by["preemptible"].cost == 16
