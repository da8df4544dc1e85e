"""Capacity through the HTTP API (fake provider): reservations and pools set
aside for a project, what they hold back from others, how a cluster's GPUs
split into reserved / pool / on-demand, queued requests and scheduled
clusters that start and end with their window."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.api import ApiHarness
from support.fleets import four_hosts

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides(tmp_path: Path) -> Iterator[dict[str, Any]]:
    fleet = four_hosts(tmp_path / "fleet.yaml")
    yield {"fleet_file": fleet, "gpu_hour_rates": {"H100_SXM": {"on_demand": 2.0}}}


def _iso(dt: datetime) -> str:
    return dt.isoformat()


def _window(start: timedelta, end: timedelta) -> dict[str, str]:
    now = datetime.now(UTC)
    return {"start": _iso(now + start), "end": _iso(now + end)}


async def _reserve(api: ApiHarness, name: str, project: str, gpus: int, **extra: Any) -> Any:
    body = {
        "name": name,
        "project": project,
        "num_gpus": gpus,
        "windows": [_window(-timedelta(hours=1), timedelta(days=2))],
        **extra,
    }
    return await api.client.post("/v1/capacity", json=body)


async def _cluster(
    api: ApiHarness, name: str, gpus: int, project: str = "default", **kw: Any
) -> httpx.Response:
    return await api.client.post(
        f"/v1/projects/{project}/clusters",
        json={"name": name, "cluster_type": "kubernetes", "num_gpus": gpus, **kw},
    )


async def test_reservations_are_validated_and_never_overbook(api: ApiHarness) -> None:
    r = await _reserve(api, "r1", "default", 12)
    assert r.status_code == 422 and r.json()["field"] == "num_gpus"
    r = await _reserve(api, "r1", "nope", 8)
    assert r.status_code == 404 and r.json()["field"] == "project"
    r = await api.client.post(
        "/v1/capacity",
        json={
            "name": "short",
            "project": "default",
            "num_gpus": 8,
            "windows": [_window(timedelta(0), timedelta(hours=2))],
        },
    )
    assert r.status_code == 422 and "1 to 90 days" in r.json()["message"]
    r = await _reserve(api, "big", "default", 40)
    assert r.status_code == 409 and r.json()["code"] == "capacity_unavailable"
    assert "at most 32 GPUs" in r.json()["message"]
    assert (await api.client.get("/v1/capacity")).json() == []

    r = await _reserve(api, "r1", "default", 24)
    assert r.status_code == 201, r.text
    assert r.json()["windows"][0]["active"] is True
    r = await _reserve(api, "r2", "default", 16)  # only 8 left
    assert r.status_code == 409 and "at most 8 GPUs" in r.json()["message"]
    r = await _reserve(api, "r1", "default", 8)
    assert r.status_code == 409 and r.json()["code"] == "already_exists"

    # A pool with two windows, one in the future.
    r = await api.client.post(
        "/v1/capacity",
        json={
            "name": "pool-a",
            "project": "default",
            "kind": "pool",
            "num_gpus": 8,
            "windows": [
                _window(timedelta(days=3), timedelta(days=4)),
                _window(timedelta(days=5), timedelta(days=6)),
            ],
        },
    )
    assert r.status_code == 201, r.text
    assert [w["active"] for w in r.json()["windows"]] == [False, False]
    names = sorted(c["name"] for c in (await api.client.get("/v1/capacity")).json())
    assert names == ["pool-a", "r1"]
    assert (await api.client.delete("/v1/capacity/pool-a")).status_code == 204
    assert (await api.client.delete("/v1/capacity/pool-a")).status_code == 404


async def test_reserved_capacity_is_held_back_and_split(api: ApiHarness) -> None:
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    assert (await _reserve(api, "other-r", "other", 16)).status_code == 201

    # default may not take the two hosts other holds.
    r = await _cluster(api, "d1", 24)
    assert r.status_code == 409 and "held for other projects' reservations" in r.json()["message"]
    r = await _cluster(api, "d1", 16)
    assert r.status_code == 201, r.text
    assert r.json()["capacity"] == {"reserved_gpus": 0, "pool_gpus": 0, "on_demand_gpus": 16}

    # other uses its reservation; beyond it, it is on-demand (no room here).
    r = await _cluster(api, "o1", 16, project="other")
    assert r.status_code == 201, r.text
    assert r.json()["capacity"] == {"reserved_gpus": 16, "pool_gpus": 0, "on_demand_gpus": 0}
    await api.wait_cluster("o1", {"ready"}, project="other")
    await api.wait_cluster("d1", {"ready"})
    usage = (await api.client.get("/v1/projects/other/usage")).json()
    assert {(ln["billing"], ln["nodes"]) for ln in usage["lines"]} == {("reserved", 2)}
    assert usage["lines"][0]["rate_per_gpu_hour"] == pytest.approx(2.0 * 0.65)
    usage = (await api.client.get(f"{P}/usage")).json()
    assert {(ln["billing"], ln["rate_per_gpu_hour"]) for ln in usage["lines"]} == {
        ("on_demand", 2.0)
    }

    # A cluster larger than the reservation: the rest is on-demand.
    r = await api.client.delete("/v1/projects/other/clusters/o1")
    await api.wait_cluster("o1", {"gone"}, project="other")
    r = await api.client.delete(f"{P}/clusters/d1")
    await api.wait_cluster("d1", {"gone"})
    r = await _cluster(api, "o2", 24, project="other")
    assert r.status_code == 201, r.text
    assert r.json()["capacity"] == {"reserved_gpus": 16, "pool_gpus": 0, "on_demand_gpus": 8}


async def test_a_request_waits_for_its_start_time(api: ApiHarness) -> None:
    start = datetime.now(UTC) + timedelta(seconds=1.5)
    r = await _cluster(api, "later", 8, start_at=_iso(start))
    assert r.status_code == 201, r.text
    body = r.json()
    assert (
        body["status"] == "queued" and body["nodes"] == [] and "starts at" in body["status_message"]
    )
    ready = await api.wait_cluster("later", {"ready", "failed"})
    assert ready["status"] == "ready" and len(ready["nodes"]) == 1
    first = next(p for p in ready["phase_history"] if p["phase"] == "waiting_for_control_plane")
    assert datetime.fromisoformat(first["timestamp"]) >= start

    r = await _cluster(api, "naive", 8, start_at="2030-01-01T00:00:00")
    assert r.status_code == 422 and "time zone" in r.json()["message"]


async def test_a_request_can_queue_until_capacity_frees(api: ApiHarness) -> None:
    assert (await _cluster(api, "full", 32)).status_code == 201
    await api.wait_cluster("full", {"ready"})
    r = await _cluster(api, "waiter", 16)
    assert r.status_code == 409 and r.json()["code"] == "capacity_unavailable"
    r = await _cluster(api, "waiter", 16, queue_if_unavailable=True)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "queued"
    assert "waiting for capacity" in r.json()["status_message"]
    await asyncio.sleep(0.5)
    assert (await api.client.get(f"{P}/clusters/waiter")).json()["nodes"] == []
    # Scaling a queued request changes what it will ask for.
    r = await api.client.patch(f"{P}/clusters/waiter", json={"num_gpus": 8})
    assert r.status_code == 200 and r.json()["num_gpus"] == 8
    await api.client.delete(f"{P}/clusters/full")
    ready = await api.wait_cluster("waiter", {"ready", "failed"})
    assert ready["status"] == "ready" and len(ready["nodes"]) == 1


async def test_scheduled_cluster_starts_and_ends_with_its_window(api: ApiHarness) -> None:
    now = datetime.now(UTC)
    r = await _cluster(
        api,
        "sched",
        8,
        billing_type="scheduled_capacity",
        reservation_start=_iso(now + timedelta(seconds=1)),
        reservation_end=_iso(now + timedelta(seconds=4)),
    )
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "queued" and r.json()["nodes"] == []
    await api.wait_cluster("sched", {"ready"})
    # It ends within 24 h: every node is warned, once.
    for _ in range(100):
        events = (
            await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": "sched"})
        ).json()
        if any(e["reason"] == "ReservationEnding" for e in events):
            break
        await asyncio.sleep(0.05)
    warn = [e for e in events if e["reason"] == "ReservationEnding"]
    assert len(warn) == 1 and warn[0]["count"] == 1 and "is deleted then" in warn[0]["message"]
    # At the end it is deleted; its volume stays.
    await api.wait_cluster("sched", {"gone"}, within_s=20)
    vol = (await api.client.get(f"{P}/volumes/sched-shared")).json()
    assert vol["status"] == "available"

    r = await _cluster(
        api,
        "past",
        8,
        billing_type="scheduled_capacity",
        reservation_start=_iso(now - timedelta(hours=2)),
        reservation_end=_iso(now - timedelta(hours=1)),
    )
    assert r.status_code == 422 and r.json()["field"] == "reservation_end"
