"""Cluster lifecycle through the HTTP API, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from support.api import ApiHarness

P = "/v1/projects/default"


async def _create(api: ApiHarness, **body: Any) -> dict[str, Any]:
    payload = {"name": "demo", "cluster_type": "slurm", "num_gpus": 16, **body}
    r = await api.client.post(f"{P}/clusters", json=payload)
    assert r.status_code == 201, r.text
    return r.json()


async def test_create_reaches_ready_with_nodes_on_distinct_hosts_in_one_island(
    api: ApiHarness,
) -> None:
    created = await _create(api)
    assert created["status"] == "queued"
    assert [p["phase"] for p in created["phase_history"]] == ["queued"]
    assert len(created["nodes"]) == 2

    ready = await api.wait_cluster("demo", {"ready", "failed"})
    assert ready["status"] == "ready"
    phases = [p["phase"] for p in ready["phase_history"]]
    assert phases == [
        "queued",
        "waiting_for_control_plane",
        "waiting_for_volume",
        "waiting_for_nodes",
        "running_acceptance_tests",
        "ready",
    ]
    nodes = ready["nodes"]
    assert {n["phase"] for n in nodes} == {"running"}
    assert len({n["host"] for n in nodes}) == 2
    assert all(n["compute_class"] == "standard" and "-standard-" in n["name"] for n in nodes)
    assert ready["volume"] == "demo-shared"

    hosts = {
        h["name"]: h for h in (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    }
    assert len({hosts[n["host"]]["ib_island"] for n in nodes}) == 1
    assert all(hosts[n["host"]]["cluster"] == "demo" for n in nodes)

    events = (await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": "demo"})).json()
    assert sorted(e["reason"] for e in events) == ["NodeAdded", "NodeAdded"]
    assert {e["node"] for e in events} == {n["name"] for n in nodes}

    vol = (await api.client.get(f"{P}/volumes/demo-shared")).json()
    assert vol["status"] == "bound" and vol["cluster"] == "demo"


async def test_gpu_count_must_be_multiple_of_8_and_nothing_is_created(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "bad", "cluster_type": "slurm", "num_gpus": 12}
    )
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "invalid_input"
    assert body["field"] == "num_gpus"
    assert "multiple of 8" in body["message"] and "12" in body["message"]
    assert (await api.client.get(f"{P}/clusters")).json() == []
    assert (await api.client.get(f"{P}/volumes")).json() == []


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"name": "Bad_Name"}, "name", "lowercase"),
        ({"num_gpus": 0}, "num_gpus", "at least 8"),
        ({"num_preemptible_gpus": 4}, "num_preemptible_gpus", "multiple of 8"),
        ({"cluster_type": "nomad"}, "cluster_type", "kubernetes"),
        ({"gpu_type": "TPU_V9"}, "gpu_type", "unknown GPU type"),
        ({"region": "mars-1"}, "region", "unknown region"),
        ({"volume_size_tib": 0}, "volume_size_tib", "at least 1"),
        ({"billing_type": "reserved"}, "reservation_end", "needs reservation_start"),
        (
            {
                "billing_type": "reserved",
                "reservation_start": "2027-01-01T00:00:00Z",
                "reservation_end": "2027-06-01T00:00:00Z",
            },
            "reservation_end",
            "1 to 90 days",
        ),
        ({"surprise": 1}, "surprise", "not permitted"),
    ],
)
async def test_bad_input_names_field_and_rule(
    api: ApiHarness, patch: dict[str, Any], field: str, words: str
) -> None:
    payload = {"name": "c1", "cluster_type": "slurm", "num_gpus": 8, **patch}
    r = await api.client.post(f"{P}/clusters", json=payload)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "invalid_input"
    assert body["field"] == field
    assert words in body["message"]
    assert (await api.client.get(f"{P}/clusters")).json() == []
    assert (await api.client.get(f"{P}/volumes")).json() == []


async def test_duplicate_name_conflicts(api: ApiHarness) -> None:
    await _create(api)
    r = await api.client.post(
        f"{P}/clusters", json={"name": "demo", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 409
    assert r.json()["code"] == "already_exists"


async def test_capacity_unavailable_changes_nothing(api: ApiHarness) -> None:
    # The default fake fleet has 16 H100 hosts; ask for 17 nodes.
    r = await api.client.post(
        f"{P}/clusters", json={"name": "huge", "cluster_type": "slurm", "num_gpus": 17 * 8}
    )
    assert r.status_code == 409
    body = r.json()
    assert body["code"] == "capacity_unavailable"
    assert "16 free" in body["message"] and "H100_SXM" in body["message"]
    assert (await api.client.get(f"{P}/clusters")).json() == []
    assert (await api.client.get(f"{P}/volumes")).json() == []
    hosts = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    assert all(h["node"] is None for h in hosts)


async def test_scale_up_then_down(api: ApiHarness) -> None:
    await _create(api)
    await api.wait_cluster("demo", {"ready"})
    r = await api.client.patch(f"{P}/clusters/demo", json={"num_gpus": 32})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "waiting_for_nodes"
    ready = await api.wait_cluster("demo", {"ready"})
    assert len(ready["nodes"]) == 4 and ready["num_gpus"] == 32
    events = (await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": "demo"})).json()
    assert sum(e["reason"] == "ScaledUp" for e in events) == 2

    first_two = {n["name"] for n in ready["nodes"][:2]}
    r = await api.client.patch(f"{P}/clusters/demo", json={"num_gpus": 16})
    assert r.status_code == 200
    for _ in range(200):
        nodes = (await api.client.get(f"{P}/nodes", params={"cluster": "demo"})).json()
        if len(nodes) == 2:
            break
        await api_sleep()
    assert len(nodes) == 2
    # The newest nodes go first; the original ones stay.
    assert {n["name"] for n in nodes} == first_two
    everything = (
        await api.client.get(f"{P}/nodes", params={"cluster": "demo", "include_deleted": True})
    ).json()
    gone = [n for n in everything if n["deleted_at"] is not None]
    assert len(gone) == 2 and {n["phase"] for n in gone} == {"deleted"}
    events = (await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": "demo"})).json()
    assert sum(e["reason"] == "ScaledDown" for e in events) == 2
    final = await api.wait_cluster("demo", {"ready"})
    assert len(final["nodes"]) == 2


async def api_sleep() -> None:
    await asyncio.sleep(0.05)


async def test_scale_beyond_capacity_changes_nothing(api: ApiHarness) -> None:
    await _create(api)
    await api.wait_cluster("demo", {"ready"})
    r = await api.client.patch(f"{P}/clusters/demo", json={"num_gpus": 8 * 40})
    assert r.status_code == 409 and r.json()["code"] == "capacity_unavailable"
    after = (await api.client.get(f"{P}/clusters/demo")).json()
    assert after["num_gpus"] == 16 and len(after["nodes"]) == 2 and after["status"] == "ready"


async def test_preemptible_target_is_stored(api: ApiHarness) -> None:
    created = await _create(api, num_preemptible_gpus=16)
    assert created["num_preemptible_gpus"] == 16
    assert created["desired_preemptible_gpus"] == 16
    assert created["allocated_preemptible_gpus"] == 0
    r = await api.client.patch(f"{P}/clusters/demo", json={"num_preemptible_gpus": 8})
    assert r.json()["desired_preemptible_gpus"] == 8


async def test_delete_keeps_volume_unless_asked(api: ApiHarness) -> None:
    await _create(api)
    await api.wait_cluster("demo", {"ready"})
    r = await api.client.delete(f"{P}/clusters/demo")
    assert r.status_code == 202 and r.json()["status"] == "deleting"
    again = await api.client.delete(f"{P}/clusters/demo")
    assert again.status_code in (202, 404)
    await api.wait_cluster("demo", {"gone"})
    vols = (await api.client.get(f"{P}/volumes")).json()
    assert [(v["name"], v["status"], v["cluster"]) for v in vols] == [
        ("demo-shared", "available", None)
    ]
    assert (api.settings.home / "volumes").is_dir()
    hosts = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    assert all(h["node"] is None for h in hosts)

    # The kept volume can be attached to a new cluster.
    await _create(api, name="demo2", volume="demo-shared")
    ready = await api.wait_cluster("demo2", {"ready"})
    assert ready["volume"] == "demo-shared"
    r = await api.client.delete(f"{P}/clusters/demo2", params={"delete_volume": True})
    assert r.status_code == 202
    await api.wait_cluster("demo2", {"gone"})
    for _ in range(100):
        if (await api.client.get(f"{P}/volumes")).json() == []:
            break
        await api_sleep()
    assert (await api.client.get(f"{P}/volumes")).json() == []


async def test_deleted_clusters_nodes_and_events_stay_listed(api: ApiHarness) -> None:
    await _create(api)
    await api.wait_cluster("demo", {"ready"})
    await api.client.delete(f"{P}/clusters/demo")
    await api.wait_cluster("demo", {"gone"})
    live = await api.client.get(f"{P}/nodes", params={"cluster": "demo"})
    assert live.status_code == 404
    old = await api.client.get(f"{P}/nodes", params={"cluster": "demo", "include_deleted": True})
    assert old.status_code == 200
    assert [n["phase"] for n in old.json()] == ["deleted", "deleted"]
    assert all(n["deleted_at"] for n in old.json())
    events = (await api.client.get(f"{P}/events", params={"limit": 1000, "cluster": "demo"})).json()
    assert sorted(e["reason"] for e in events) == ["NodeAdded", "NodeAdded"]


async def test_concurrent_creates_fill_the_fleet_without_double_booking(api: ApiHarness) -> None:
    async def create(i: int) -> int:
        r = await api.client.post(
            f"{P}/clusters", json={"name": f"c{i}", "cluster_type": "slurm", "num_gpus": 16}
        )
        return r.status_code

    # 9 clusters of 2 nodes ask for 18 of the 16 H100 hosts, all at once.
    codes = await asyncio.gather(*(create(i) for i in range(9)))
    assert sorted(codes) == [201] * 8 + [409]
    hosts = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    used = [h for h in hosts if h["node"] is not None]
    assert len(used) == 16 and {h["gpu_type"] for h in used} == {"H100_SXM"}
    clusters = (await api.client.get(f"{P}/clusters")).json()
    assert len(clusters) == 8
    for c in clusters:
        assert len({n["host"] for n in c["nodes"]}) == 2
    # Only the clusters that were created have volumes.
    assert len((await api.client.get(f"{P}/volumes")).json()) == 8
