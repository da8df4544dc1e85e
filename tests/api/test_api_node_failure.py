"""A node that fails to boot fails a cluster that never became ready."""

from __future__ import annotations

from typing import Any

import pytest

from support.api import ApiHarness

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    # Placement fills island ib-a first, by host name: h100-a-01 gets the node.
    return {"fake_fail_hosts": ["h100-a-01"]}


async def test_failed_node_fails_the_cluster(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "demo", "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201
    assert r.json()["nodes"][0]["host"] == "h100-a-01"
    done = await api.wait_cluster("demo", {"ready", "failed"})
    assert done["status"] == "failed"
    assert "failed" in done["status_message"]
    assert done["nodes"][0]["phase"] == "failed"
    events = (await api.client.get(f"{P}/events", params={"limit": 1000})).json()
    assert [e["reason"] for e in events] == ["NodeFailed"]

    # A failed cluster can still be deleted, and its host comes back.
    assert (await api.client.delete(f"{P}/clusters/demo")).status_code == 202
    await api.wait_cluster("demo", {"gone"})
    hosts = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    assert all(h["node"] is None for h in hosts)
