"""Projects, API keys, roles and tenant isolation."""

from __future__ import annotations

import stat

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gpuclusters.core.clientconfig import config_path
from support.api import ApiHarness


async def _key(api: ApiHarness, *, user: str, project: str, role: str) -> str:
    r = await api.client.post("/v1/api-keys", json={"user": user, "project": project, "role": role})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["key"].startswith("gpc_") and body["role"] == role
    return str(body["key"])


async def test_bootstrap_writes_private_config(api: ApiHarness) -> None:
    path = config_path(api.settings.home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    who = (await api.client.get("/v1/whoami")).json()
    assert who == {
        "user": "admin",
        "organization": "default",
        "is_admin": True,
        "projects": {"default": "admin"},
    }


async def test_keys_are_stored_hashed(api: ApiHarness) -> None:
    engine = create_async_engine(api.settings.sqlalchemy_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("select key_hash, key_prefix from api_keys"))).all()
    finally:
        await engine.dispose()
    assert rows
    for key_hash, prefix in rows:
        assert api.admin_key not in (key_hash, prefix)
        assert len(key_hash) == 64


async def test_missing_and_bad_keys_are_refused(api: ApiHarness) -> None:
    async with api.as_key("gpc_not-a-real-key") as bad:
        r = await bad.get("/v1/projects/default/clusters")
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = await api.client.get("/v1/projects/default/clusters", headers={"Authorization": ""})
    assert r.status_code == 401 and "Bearer" in r.json()["message"]


async def test_other_project_cannot_see_or_delete(api: ApiHarness) -> None:
    r = await api.client.post(
        "/v1/projects/default/clusters",
        json={"name": "demo", "cluster_type": "slurm", "num_gpus": 8},
    )
    assert r.status_code == 201
    assert (await api.client.post("/v1/projects", json={"name": "p2"})).status_code == 201
    bob = await _key(api, user="bob", project="p2", role="admin")

    async with api.as_key(bob) as c:
        for method, path in [
            ("GET", "/v1/projects/default/clusters/demo"),
            ("DELETE", "/v1/projects/default/clusters/demo"),
            ("GET", "/v1/projects/default/clusters"),
            ("GET", "/v1/projects/default/volumes"),
            ("GET", "/v1/projects/default/nodes"),
        ]:
            r = await c.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["code"] == "not_found"
        assert (await c.get("/v1/projects/p2/clusters")).json() == []
        assert [p["name"] for p in (await c.get("/v1/projects")).json()] == ["p2"]
        # Not an org admin: no hosts, no new projects.
        assert (await c.get("/v1/hosts")).status_code == 403
        assert (await c.post("/v1/projects", json={"name": "p3"})).status_code == 403
        # Admin of p2 may create clusters there.
        r = await c.post(
            "/v1/projects/p2/clusters",
            json={"name": "demo", "cluster_type": "kubernetes", "num_gpus": 8},
        )
        assert r.status_code == 201

    still = await api.client.get("/v1/projects/default/clusters/demo")
    assert still.status_code == 200 and still.json()["status"] != "deleting"


async def test_editor_reads_but_cannot_change(api: ApiHarness) -> None:
    r = await api.client.post(
        "/v1/projects/default/clusters",
        json={"name": "demo", "cluster_type": "slurm", "num_gpus": 8},
    )
    assert r.status_code == 201
    eve = await _key(api, user="eve", project="default", role="editor")
    async with api.as_key(eve) as c:
        assert (await c.get("/v1/projects/default/clusters/demo")).status_code == 200
        for method, path, body in [
            ("DELETE", "/v1/projects/default/clusters/demo", None),
            ("PATCH", "/v1/projects/default/clusters/demo", {"num_gpus": 16}),
            (
                "POST",
                "/v1/projects/default/clusters",
                {"name": "x", "cluster_type": "slurm", "num_gpus": 8},
            ),
            ("POST", "/v1/projects/default/volumes", {"name": "v"}),
            ("POST", "/v1/api-keys", {"user": "mallory", "project": "default", "role": "admin"}),
        ]:
            r = await c.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["code"] == "forbidden"


async def test_duplicate_project(api: ApiHarness) -> None:
    assert (await api.client.post("/v1/projects", json={"name": "p2"})).status_code == 201
    r = await api.client.post("/v1/projects", json={"name": "p2"})
    assert r.status_code == 409 and r.json()["code"] == "already_exists"


async def test_each_project_gets_its_own_host_id_block(api: ApiHarness) -> None:
    """Blocks of 65536 host ids from the configured start, one per project
    in creation order; a refused duplicate takes none."""
    start = api.settings.id_blocks_start
    for name in ("ids-a", "ids-b"):
        assert (await api.client.post("/v1/projects", json={"name": name})).status_code == 201
    assert (await api.client.post("/v1/projects", json={"name": "ids-a"})).status_code == 409
    made = (await api.client.post("/v1/projects", json={"name": "ids-c"})).json()
    listed = {p["name"]: p["host_ids"] for p in (await api.client.get("/v1/projects")).json()}
    assert listed["default"] == {"first": start, "last": start + 65535}
    assert listed["ids-a"] == {"first": start + 65536, "last": start + 2 * 65536 - 1}
    assert listed["ids-b"]["first"] == start + 2 * 65536
    assert (
        made["host_ids"]
        == listed["ids-c"]
        == {"first": start + 3 * 65536, "last": start + 4 * 65536 - 1}
    )
