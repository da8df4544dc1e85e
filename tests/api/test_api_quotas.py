"""Project quotas (services/quotas.py, core/quotas.py): organization admins
set them; a create, scale or resize that would exceed one is refused with
409 quota_exceeded naming the quota, its limit and the use, and changes
nothing; members see the limits and the use; shrinking is never refused."""

from __future__ import annotations

from typing import Any

import httpx

from support.api import ApiHarness

P = "/v1/projects/default"


async def _quota(api: ApiHarness) -> dict[str, Any]:
    r = await api.client.get(f"{P}/quota")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _refused(r: Any, quota: str) -> str:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == "quota_exceeded" and body["field"] == quota, body
    return str(body["message"])


async def test_quotas_refuse_what_exceeds_them_and_change_nothing(api: ApiHarness) -> None:
    assert (await _quota(api))["limits"] == {
        "standard_gpus": None, "preemptible_gpus": None, "clusters": None, "volume_tib": None,
    }  # fmt: skip
    r = await api.client.put(
        f"{P}/quota", json={"standard_gpus": 16, "clusters": 2, "volume_tib": 3}
    )
    assert r.status_code == 200, r.text
    r = await api.client.post(
        f"{P}/clusters", json={"name": "q1", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("q1", {"ready"})
    assert (await _quota(api))["use"] == {
        "standard_gpus": 16, "preemptible_gpus": 0, "clusters": 1, "volume_tib": 1,
    }  # fmt: skip
    # The console's fleet page shows them, limit / use.
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as browser:
        assert (await browser.post("/login", data={"api_key": api.admin_key})).status_code == 303
        fleet = (await browser.get("/fleet")).text
    row = fleet.split('data-project="default"', 1)[1].split("</tr>", 1)[0]
    assert "16 / 16" in row and "2 / 1" in row and "3 / 1" in row and "none / 0" in row
    before = (await api.client.get(f"{P}/clusters")).json()
    volumes_before = (await api.client.get(f"{P}/volumes")).json()

    # A create beyond the GPUs: refused, naming the quota, limit and use.
    message = _refused(
        await api.client.post(
            f"{P}/clusters", json={"name": "q2", "cluster_type": "slurm", "num_gpus": 8}
        ),
        "standard_gpus",
    )
    assert "16 standard GPUs" in message and "holds 16" in message and "make it 24" in message
    # A scale beyond it: refused, the cluster unchanged.
    _refused(await api.client.patch(f"{P}/clusters/q1", json={"num_gpus": 24}), "standard_gpus")
    # Volumes: a new one, and growing one, beyond the TiB.
    _refused(
        await api.client.post(f"{P}/volumes", json={"name": "big", "size_tib": 3}), "volume_tib"
    )
    _refused(await api.client.patch(f"{P}/volumes/q1-shared", json={"size_tib": 4}), "volume_tib")
    # Nothing changed.
    assert (await api.client.get(f"{P}/clusters")).json() == before
    assert (await api.client.get(f"{P}/volumes")).json() == volumes_before
    assert (await _quota(api))["use"]["standard_gpus"] == 16

    # The number of clusters: one held, one allowed.
    assert (await api.client.put(f"{P}/quota", json={"clusters": 1})).status_code == 200
    _refused(
        await api.client.post(
            f"{P}/clusters", json={"name": "q2", "cluster_type": "slurm", "num_gpus": 8}
        ),
        "clusters",
    )
    # A lower limit than the use: the project keeps what it has and may shrink.
    assert (await api.client.put(f"{P}/quota", json={"standard_gpus": 8})).status_code == 200
    r = await api.client.patch(f"{P}/clusters/q1", json={"num_gpus": 8})
    assert r.status_code == 200, r.text
    # Cleared: no limit.
    assert (await api.client.put(f"{P}/quota", json={})).status_code == 200
    r = await api.client.patch(f"{P}/clusters/q1", json={"num_gpus": 24})
    assert r.status_code == 200, r.text


async def test_members_read_quotas_and_only_org_admins_set_them(api: ApiHarness) -> None:
    r = await api.client.post(
        "/v1/api-keys", json={"user": "pat", "project": "default", "role": "admin"}
    )
    key = r.json()["key"]
    async with api.as_key(key) as pat:
        assert (await pat.get(f"{P}/quota")).status_code == 200
        denied = await pat.put(f"{P}/quota", json={"standard_gpus": 1000})
        assert denied.status_code == 403 and denied.json()["code"] == "forbidden"
    bad = await api.client.put(f"{P}/quota", json={"standard_gpus": -1})
    assert bad.status_code == 422 and "standard_gpus" in bad.json()["message"]
    assert (await _quota(api))["limits"]["standard_gpus"] is None
