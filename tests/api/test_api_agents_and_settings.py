"""Agent heartbeats, Slurm settings, Unix uids, and ssh on a provider
without shell access."""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from gpuclusters.server.db.models import Cluster, Node, User
from gpuclusters.server.security.keys import hash_key
from support.api import ApiHarness

P = "/v1/projects/default"


async def _ready(api: ApiHarness, **extra: object) -> dict[str, object]:
    body = {"name": "demo", "cluster_type": "slurm", "num_gpus": 8, **extra}
    r = await api.client.post(f"{P}/clusters", json=body)
    assert r.status_code == 201, r.text
    return await api.wait_cluster("demo", {"ready"})


async def test_agent_heartbeat_needs_the_nodes_own_token(api: ApiHarness) -> None:
    await _ready(api)
    async with api.runtime.sessionmaker() as s:
        node = (await s.scalars(select(Node))).one()
        node.agent_token_hash = hash_key("node-secret")
        await s.commit()
        node_id, name = node.id, node.name
    beat = {"node_id": node_id, "seq": 1, "sent_at": 0.0, "gpus": []}
    bad = await api.client.post(
        "/agent/v1/heartbeat", json=beat, headers={"Authorization": "Bearer wrong"}
    )
    assert bad.status_code == 401
    # A user's API key is not an agent token either.
    assert (await api.client.post("/agent/v1/heartbeat", json=beat)).status_code == 401
    before = (await api.client.get(f"{P}/nodes/{name}")).json()
    assert before["last_heartbeat_at"] is None
    ok = await api.client.post(
        "/agent/v1/heartbeat", json=beat, headers={"Authorization": "Bearer node-secret"}
    )
    assert ok.status_code == 204
    after = (await api.client.get(f"{P}/nodes/{name}")).json()
    assert after["last_heartbeat_at"] is not None
    assert "/agent/v1/heartbeat" not in (await api.client.get("/openapi.json")).json()["paths"]


async def test_slurm_settings_are_stored_and_applied(api: ApiHarness) -> None:
    ready = await _ready(
        api, slurm={"extra_config": "SchedulerParameters=bf_continue", "prolog": "#!/bin/sh\n"}
    )
    assert ready["slurm"] == {
        "extra_config": "SchedulerParameters=bf_continue",
        "prolog": "#!/bin/sh\n",
        "epilog": None,
    }
    r = await api.client.patch(f"{P}/clusters/demo", json={"slurm": {"epilog": "#!/bin/sh\n"}})
    assert r.status_code == 200
    assert r.json()["slurm"]["epilog"] == "#!/bin/sh\n"
    for _ in range(100):
        async with api.runtime.sessionmaker() as s:
            c = (await s.scalars(select(Cluster))).one()
        if c.applied_config_generation == c.config_generation:
            break
        await api_tick()
    assert c.config_generation == 2 and c.applied_config_generation == 2


async def test_slurm_settings_validation(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters",
        json={"name": "k", "cluster_type": "kubernetes", "num_gpus": 8, "slurm": {}},
    )
    assert r.status_code == 422 and r.json()["field"] == "slurm"
    r = await api.client.post(
        f"{P}/clusters",
        json={"name": "s", "cluster_type": "slurm", "num_gpus": 8, "slurm": {"prolog": "echo"}},
    )
    assert r.status_code == 422
    assert r.json()["field"] == "slurm.prolog" and "interpreter" in r.json()["message"]


async def test_users_get_distinct_uids_and_reserved_names_are_refused(api: ApiHarness) -> None:
    for user in ("alice", "bob"):
        r = await api.client.post(
            "/v1/api-keys", json={"user": user, "project": "default", "role": "editor"}
        )
        assert r.status_code == 201
    r = await api.client.post(
        "/v1/api-keys", json={"user": "slurm", "project": "default", "role": "editor"}
    )
    assert r.status_code == 422 and r.json()["field"] == "user"
    async with api.runtime.sessionmaker() as s:
        uids = {u.name: u.uid for u in await s.scalars(select(User))}
    assert uids == {"admin": 10000, "alice": 10001, "bob": 10002}


async def test_ssh_needs_a_provider_with_shells(api: ApiHarness) -> None:
    await _ready(api)
    r = await api.client.post(f"{P}/clusters/demo/ssh", json={"command": ["hostname"]})
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    assert "netns" in r.json()["message"]


async def api_tick() -> None:
    await asyncio.sleep(0.05)


async def test_owned_slurm_keys_are_refused_when_saved(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters",
        json={
            "name": "s",
            "cluster_type": "slurm",
            "num_gpus": 8,
            "slurm": {"extra_config": "ClusterName=evil\n"},
        },
    )
    assert r.status_code == 422
    assert r.json()["field"] == "slurm.extra_config" and "ClusterName" in r.json()["message"]
    assert (await api.client.get(f"{P}/clusters")).json() == []
    await _ready(api)
    r = await api.client.patch(
        f"{P}/clusters/demo", json={"slurm": {"extra_config": "AuthType=auth/none"}}
    )
    assert r.status_code == 422 and "AuthType" in r.json()["message"]
    assert (await api.client.get(f"{P}/clusters/demo")).json()["slurm"]["extra_config"] == ""
