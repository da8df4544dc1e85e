"""The preemptible pool through the HTTP API (fake provider, no-op layer):
spare capacity fills targets, standard demand reclaims hosts with the
preemption protocol, admins reclaim hosts, and usage prices the classes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.api import ApiHarness
from support.fleets import four_hosts

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Four H100 hosts in two islands, like the embedded fleet."""
    fleet = four_hosts(tmp_path / "fleet.yaml")
    yield {
        "fleet_file": fleet,
        "preemption_grace_s": 30.0,
        "gpu_hour_rates": {"H100_SXM": {"standard": 2.0}},
        "preemptible_discount": 0.5,
    }


async def _create(api: ApiHarness, name: str, gpus: int, preemptible: int = 0) -> dict[str, Any]:
    r = await api.client.post(
        f"{P}/clusters",
        json={
            "name": name,
            "cluster_type": "slurm",
            "num_gpus": gpus,
            "num_preemptible_gpus": preemptible,
        },
    )
    assert r.status_code == 201, r.text
    return r.json()


async def _get(api: ApiHarness, name: str) -> dict[str, Any]:
    r = await api.client.get(f"{P}/clusters/{name}")
    r.raise_for_status()
    return r.json()


async def _until(api: ApiHarness, name: str, check: Any, within_s: float = 20) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        c = await _get(api, name)
        if check(c):
            return c
        if loop.time() > deadline:
            raise AssertionError(f"cluster {name} never satisfied the check: {c}")
        await asyncio.sleep(0.05)


def _preemptible(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [n for n in c["nodes"] if n["compute_class"] == "preemptible"]


async def _events(api: ApiHarness, cluster: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": cluster})
    r.raise_for_status()
    return list(r.json())


async def test_spare_capacity_fills_the_target_and_standard_demand_reclaims_it(
    api: ApiHarness,
) -> None:
    created = await _create(api, "p1", 8, preemptible=16)
    assert created["desired_preemptible_gpus"] == 16
    p1 = await _until(api, "p1", lambda c: c["allocated_preemptible_gpus"] == 16)
    pre = _preemptible(p1)
    assert len(pre) == 2 and all("-preemptible-" in n["name"] for n in pre)
    assert len({n["host"] for n in p1["nodes"]}) == 3
    scaled_up = [e for e in await _events(api, "p1") if e["reason"] == "ScaledUp"]
    assert {e["node"] for e in scaled_up} == {n["name"] for n in pre}

    # s2 needs two hosts: the free one and one a preemptible node holds.
    s2 = await _create(api, "s2", 16)
    waiting = [n for n in s2["nodes"] if n["host"] is None]
    assert len(waiting) == 1 and "preemptible node" in waiting[0]["message"]
    ready = await api.wait_cluster("s2", {"ready", "failed"})
    assert ready["status"] == "ready"
    p1 = await _until(api, "p1", lambda c: len(_preemptible(c)) == 1)
    assert p1["allocated_preemptible_gpus"] == 8 and p1["desired_preemptible_gpus"] == 16
    victim = ({n["name"] for n in pre} - {n["name"] for n in _preemptible(p1)}).pop()
    reasons = {e["reason"]: e for e in await _events(api, "p1") if e["node"] == victim}
    assert {"PreemptionNotified", "Preempted"} <= set(reasons)
    assert reasons["PreemptionNotified"]["timestamp"] <= reasons["Preempted"]["timestamp"]
    assert "cluster s2" in reasons["PreemptionNotified"]["message"]
    deleted = (
        await api.client.get(f"{P}/nodes", params={"cluster": "p1", "include_deleted": True})
    ).json()
    assert any(n["name"] == victim and n["deleted_at"] for n in deleted)

    # No capacity even with reclaim: a clear answer, and nothing changes.
    r = await api.client.post(
        f"{P}/clusters", json={"name": "big", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 409 and r.json()["code"] == "capacity_unavailable"
    assert "preemptible" in r.json()["message"]
    assert (await api.client.get(f"{P}/clusters/big")).status_code == 404
    again = await _get(api, "p1")
    assert [n["name"] for n in _preemptible(again)] == [n["name"] for n in _preemptible(p1)]
    assert all(n["phase"] == "running" for n in again["nodes"])

    # Capacity returns: the target is restored.
    r = await api.client.delete(f"{P}/clusters/s2")
    assert r.status_code == 202
    await api.wait_cluster("s2", {"gone"})
    p1 = await _until(api, "p1", lambda c: c["allocated_preemptible_gpus"] == 16)
    assert len(_preemptible(p1)) == 2


async def test_lowering_the_target_removes_the_surplus(api: ApiHarness) -> None:
    await _create(api, "p1", 8, preemptible=24)
    await _until(api, "p1", lambda c: c["allocated_preemptible_gpus"] == 24)
    r = await api.client.patch(f"{P}/clusters/p1", json={"num_preemptible_gpus": 8})
    assert r.status_code == 200, r.text
    p1 = await _until(api, "p1", lambda c: len(_preemptible(c)) == 1)
    assert p1["allocated_preemptible_gpus"] == 8
    # Removal by the user is a scale-down, not a preemption.
    reasons = {e["reason"] for e in await _events(api, "p1")}
    assert "ScaledDown" in reasons and "Preempted" not in reasons


async def test_admin_reclaims_a_host_and_gives_it_back(api: ApiHarness) -> None:
    await _create(api, "p1", 8, preemptible=8)
    p1 = await _until(api, "p1", lambda c: c["allocated_preemptible_gpus"] == 8)
    (pre,) = _preemptible(p1)
    standard = next(n for n in p1["nodes"] if n["compute_class"] == "standard")

    r = await api.client.post(f"/v1/hosts/{standard['host']}/reclaim")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    r = await api.client.post("/v1/hosts/nope/reclaim")
    assert r.status_code == 404

    r = await api.client.post(f"/v1/hosts/{pre['host']}/reclaim")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cordoned"
    # The pool refills on another spare host, never on the reclaimed one.
    p1 = await _until(
        api,
        "p1",
        lambda c: (
            c["allocated_preemptible_gpus"] == 8
            and pre["name"] not in {n["name"] for n in c["nodes"]}
        ),
    )
    assert _preemptible(p1)[0]["host"] != pre["host"]
    reasons = {e["reason"] for e in await _events(api, "p1") if e["node"] == pre["name"]}
    assert {"PreemptionNotified", "Preempted"} <= reasons
    hosts = {
        h["name"]: h for h in (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    }
    assert hosts[pre["host"]]["state"] == "cordoned" and hosts[pre["host"]]["node"] is None

    r = await api.client.post(f"/v1/hosts/{pre['host']}/uncordon")
    assert r.status_code == 200 and r.json()["state"] == "available"

    # Editors may not touch the fleet.
    r = await api.client.post(
        "/v1/api-keys", json={"user": "eve", "project": "default", "role": "editor"}
    )
    assert r.status_code == 201, r.text
    async with api.as_key(r.json()["key"]) as eve:
        assert (await eve.post(f"/v1/hosts/{pre['host']}/reclaim")).status_code == 403


async def test_usage_prices_preemptible_hours_at_the_discount(api: ApiHarness) -> None:
    await _create(api, "p1", 8, preemptible=8)
    await _until(api, "p1", lambda c: c["allocated_preemptible_gpus"] == 8)
    await asyncio.sleep(0.3)
    r = await api.client.get(f"{P}/usage")
    assert r.status_code == 200, r.text
    report = r.json()
    lines = {line["compute_class"]: line for line in report["lines"]}
    assert set(lines) == {"standard", "preemptible"}
    assert lines["standard"]["rate_per_gpu_hour"] == 2.0
    assert lines["preemptible"]["rate_per_gpu_hour"] == 1.0
    for line in lines.values():
        assert line["cluster"] == "p1" and line["nodes"] == 1 and line["gpu_hours"] > 0
        assert line["cost"] == pytest.approx(
            line["gpu_hours"] * line["rate_per_gpu_hour"], abs=1e-3
        )

    # Deleting the cluster closes the records: usage stops growing.
    await api.client.delete(f"{P}/clusters/p1")
    await api.wait_cluster("p1", {"gone"})
    first = (await api.client.get(f"{P}/usage")).json()["total_gpu_hours"]
    await asyncio.sleep(0.3)
    assert (await api.client.get(f"{P}/usage")).json()["total_gpu_hours"] == first

    r = await api.client.get(f"{P}/usage", params={"since": "2026-12-02T00:00:00"})
    assert r.status_code == 422 and r.json()["field"] == "since"
