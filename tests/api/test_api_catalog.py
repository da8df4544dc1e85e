"""System endpoints, the catalog and volumes."""

from __future__ import annotations

import asyncio

from support.api import ApiHarness

P = "/v1/projects/default"


async def test_system_endpoints(api: ApiHarness) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    spec = (await api.client.get("/openapi.json")).json()
    assert "/v1/projects/{project}/clusters" in spec["paths"]
    await api.client.get(f"{P}/clusters")
    metrics = (await api.client.get("/metrics")).text
    assert "gpuclusters_http_requests_total" in metrics
    assert 'route="/v1/projects/{project}/clusters"' in metrics


async def test_gpu_types_regions_hosts(api: ApiHarness) -> None:
    types = {t["name"]: t for t in (await api.client.get("/v1/gpu-types")).json()}
    assert types["H100_SXM"]["total_hosts"] == 16 and types["H100_SXM"]["free_hosts"] == 16
    assert types["H200_SXM"]["total_hosts"] == 4
    assert types["B200_SXM"]["total_hosts"] == 0
    regions = (await api.client.get("/v1/regions")).json()
    assert regions == [
        {"name": "local-1", "gpu_types": ["H100_SXM", "H200_SXM"], "total_hosts": 20}
    ]
    hosts = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    assert len(hosts) == 20
    assert {h["ib_island"] for h in hosts} == {"ib-a", "ib-b", "ib-c"}
    assert all(h["num_gpus"] == 8 and h["state"] == "available" for h in hosts)


async def test_unknown_route_is_json_404(api: ApiHarness) -> None:
    r = await api.client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


async def test_volume_lifecycle(api: ApiHarness) -> None:
    r = await api.client.post(f"{P}/volumes", json={"name": "data", "size_tib": 2})
    assert r.status_code == 201 and r.json()["status"] == "provisioning"
    for _ in range(100):
        vol = (await api.client.get(f"{P}/volumes/data")).json()
        if vol["status"] == "available":
            break
        await _tick()
    assert vol["status"] == "available" and vol["is_lifecycle_independent"] is True

    shrink = await api.client.patch(f"{P}/volumes/data", json={"size_tib": 1})
    assert shrink.status_code == 422 and shrink.json()["field"] == "size_tib"
    assert "never shrink" in shrink.json()["message"]
    grow = await api.client.patch(f"{P}/volumes/data", json={"size_tib": 3})
    assert grow.status_code == 200 and grow.json()["size_tib"] == 3

    zero = await api.client.post(f"{P}/volumes", json={"name": "z", "size_tib": 0})
    assert zero.status_code == 422 and zero.json()["field"] == "size_tib"
    dup = await api.client.post(f"{P}/volumes", json={"name": "data"})
    assert dup.status_code == 409

    r = await api.client.post(
        f"{P}/clusters",
        json={"name": "c1", "cluster_type": "slurm", "num_gpus": 8, "volume": "data"},
    )
    assert r.status_code == 201
    await api.wait_cluster("c1", {"ready"})
    busy = await api.client.delete(f"{P}/volumes/data")
    assert busy.status_code == 409 and busy.json()["code"] == "invalid_state"
    other = await api.client.post(
        f"{P}/clusters",
        json={"name": "c2", "cluster_type": "slurm", "num_gpus": 8, "volume": "data"},
    )
    assert other.status_code == 409 and other.json()["field"] == "volume"

    await api.client.delete(f"{P}/clusters/c1")
    await api.wait_cluster("c1", {"gone"})
    volume_dir = api.settings.home / "volumes"
    assert any(volume_dir.iterdir())
    assert (await api.client.delete(f"{P}/volumes/data")).status_code == 202
    for _ in range(100):
        if (await api.client.get(f"{P}/volumes/data")).status_code == 404:
            break
        await _tick()
    assert (await api.client.get(f"{P}/volumes/data")).status_code == 404
    assert not any(volume_dir.iterdir())


async def _tick() -> None:
    await asyncio.sleep(0.05)
