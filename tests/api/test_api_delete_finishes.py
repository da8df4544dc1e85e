"""A delete always finishes, through the API (issue 26): for a cluster whose
control plane failed, one whose Slurm never came up (the cluster waits,
retrying, and ``scontrol delete`` can never work), and one whose layer keeps
failing after it came up, deleted with ``force`` by an organization admin.
The layers are the scripted one of ``gpuclusters.layers.testing``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gpuclusters.core.enums import ClusterType
from gpuclusters.layers.base import LayerError, PermanentLayerError
from gpuclusters.layers.testing import ScriptedLayer
from support.api import ApiHarness

P = "/v1/projects/default"


@pytest.fixture
def layer(api: ApiHarness) -> ScriptedLayer:
    scripted = ScriptedLayer()
    api.runtime.layers[ClusterType.SLURM] = scripted
    api.runtime.layers[ClusterType.KUBERNETES] = scripted
    return scripted


async def create(api: ApiHarness, name: str) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": name, "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text


async def events(api: ApiHarness, cluster: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"{P}/events", params={"cluster": cluster})
    r.raise_for_status()
    return list(r.json())


async def test_a_cluster_whose_control_plane_failed_is_deleted(
    api: ApiHarness, layer: ScriptedLayer
) -> None:
    layer.always("ensure_control_plane", PermanentLayerError("account barslap exists"))
    layer.always("remove_node", LayerError("fetch_config: DNS SRV lookup failed"))
    await create(api, "broken")
    failed = await api.wait_cluster("broken", {"failed"})
    assert failed["status_message"] == "account barslap exists"
    assert (await api.client.delete(f"{P}/clusters/broken")).status_code == 202
    await api.wait_cluster("broken", {"gone"})
    skipped = [e for e in await events(api, "broken") if e["reason"] == "StepSkipped"]
    assert skipped and "control plane never came up" in skipped[0]["message"]
    assert layer.calls_to("delete") == ["broken"]  # its service nodes still go


async def test_a_cluster_whose_slurm_never_came_up_shows_why_and_is_deleted(
    api: ApiHarness, layer: ScriptedLayer
) -> None:
    layer.always("ensure_control_plane", LayerError("slurmctld: fetch_config failed"))
    layer.always("remove_node", LayerError("fetch_config: DNS SRV lookup failed"))
    await create(api, "never")

    async def retried() -> dict[str, Any]:
        for _ in range(200):
            c = (await api.client.get(f"{P}/clusters/never")).json()
            if c["retries"] >= 2:
                return dict(c)
            await asyncio.sleep(0.05)
        raise AssertionError(c)

    cluster = await retried()
    assert cluster["status"] == "waiting_for_control_plane"
    assert cluster["last_error"] == "slurmctld: fetch_config failed"
    assert cluster["next_attempt_at"] is not None and cluster["phase_deadline_at"] is not None
    # The console says the same.
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as browser:
        r = await browser.post("/login", data={"api_key": api.admin_key})
        assert r.status_code in (200, 303), r.text
        page = (await browser.get(f"{P.removeprefix('/v1')}/clusters/never")).text
    assert 'id="cluster-attempts"' in page and "slurmctld: fetch_config failed" in page, page
    assert "must leave waiting_for_control_plane by" in page

    assert (await api.client.delete(f"{P}/clusters/never")).status_code == 202
    await api.wait_cluster("never", {"gone"})
    assert any(e["reason"] == "StepSkipped" for e in await events(api, "never"))


async def test_force_is_for_org_admins_with_a_reason_and_skips_failing_steps(
    api: ApiHarness, layer: ScriptedLayer
) -> None:
    await create(api, "stuck")
    await api.wait_cluster("stuck", {"ready"})
    layer.always("cordon", LayerError("slurmctld: connection refused"))
    layer.always("remove_node", LayerError("slurmctld: connection refused"))
    layer.always("delete", LayerError("service node: no route"))

    # Refused, changing nothing: no reason; a reason without force; a
    # project admin who is not an organization admin.
    url = f"{P}/clusters/stuck"
    r = await api.client.delete(url, params={"force": "true"})
    assert (r.status_code, r.json()["field"]) == (422, "reason"), r.text
    r = await api.client.delete(url, params={"reason": "x"})
    assert (r.status_code, r.json()["field"]) == (422, "reason"), r.text
    key = (
        await api.client.post(
            "/v1/api-keys", json={"user": "pat", "project": "default", "role": "admin"}
        )
    ).json()["key"]
    async with api.as_key(key) as pat:
        r = await pat.delete(url, params={"force": "true", "reason": "stuck"})
    assert r.status_code == 403, r.text
    assert (await api.client.get(url)).json()["status"] == "ready"

    # A plain delete retries the failing cordon: it does not finish.
    assert (await api.client.delete(url)).status_code == 202
    for _ in range(100):
        node = (await api.client.get(url)).json()["nodes"][0]
        if node["retries"] >= 1:
            break
        await asyncio.sleep(0.05)
    assert node["phase"] == "running" and "connection refused" in node["last_error"], node

    r = await api.client.delete(url, params={"force": "true", "reason": "slurmctld host lost"})
    assert r.status_code == 202, r.text
    assert r.json()["force_delete_reason"] == "by admin: slurmctld host lost"
    await api.wait_cluster("stuck", {"gone"})
    skipped = [e["message"] for e in await events(api, "stuck") if e["reason"] == "StepSkipped"]
    assert any("delete forced: by admin: slurmctld host lost" in m for m in skipped), skipped
