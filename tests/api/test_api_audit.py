"""The audit log (services/audit.py, server/audit_log.py): every mutating
API call and console action is recorded with who, from where, what, on
which object and the outcome; reads are not; organization admins read all
of it, project admins their projects', anyone else nothing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from support.api import ApiHarness

P = "/v1/projects/default"


async def _key(api: ApiHarness, *, user: str, project: str, role: str) -> str:
    r = await api.client.post("/v1/api-keys", json={"user": user, "project": project, "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def _audit(client: httpx.AsyncClient, **params: Any) -> list[dict[str, Any]]:
    r = await client.get("/v1/audit", params={k: v for k, v in params.items() if v is not None})
    assert r.status_code == 200, r.text
    return list(r.json())


async def _admin_name(api: ApiHarness) -> str:
    return str((await api.client.get("/v1/whoami")).json()["user"])


async def test_mutations_are_recorded_with_who_where_what_and_outcome(api: ApiHarness) -> None:
    admin = await _admin_name(api)
    r = await api.client.post(
        f"{P}/clusters", json={"name": "aud1", "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("aud1", {"ready"})
    # Reads are not recorded.
    assert (await api.client.get(f"{P}/clusters/aud1")).status_code == 200
    # Refused: a bad body (the field named), and nobody's key.
    bad = await api.client.post(
        f"{P}/clusters", json={"name": "aud2", "cluster_type": "slurm", "num_gpus": 7}
    )
    assert bad.status_code == 422
    async with api.as_key("gpc_not_a_key") as stranger:
        assert (await stranger.delete(f"{P}/clusters/aud1")).status_code == 401
    assert (await api.client.delete(f"{P}/clusters/aud1")).status_code == 202

    log = await _audit(api.client)
    mine = [e for e in log if e["object"].startswith("clusters/aud")]
    assert [(e["action"], e["object"], e["outcome"], e["status"]) for e in mine] == [
        ("delete_cluster", "clusters/aud1", "ok", 202),
        ("delete_cluster", "clusters/aud1", "refused", 401),
        ("create_cluster", "clusters/aud2", "refused", 422),
        ("create_cluster", "clusters/aud1", "ok", 201),
    ]
    deleted, anonymous, invalid, created = mine
    assert created["user"] == admin and created["via"] == "api"
    assert created["project"] == "default" and created["method"] == "POST"
    assert created["route"] == "/v1/projects/{project}/clusters"
    assert created["address"] == "127.0.0.1"
    assert anonymous["user"] == "" and anonymous["detail"].startswith("unauthenticated: ")
    assert invalid["user"] == admin and "num_gpus" in invalid["detail"]
    assert not [e for e in log if e["method"] == "GET"]
    # Newest first, and the filters narrow it.
    stamps = [e["timestamp"] for e in log]
    assert stamps == sorted(stamps, reverse=True)
    assert {e["user"] for e in await _audit(api.client, user=admin)} == {admin}
    assert [e["object"] for e in await _audit(api.client, object="clusters/aud2")] == [
        "clusters/aud2"
    ]
    later = (datetime.fromisoformat(deleted["timestamp"]) + timedelta(seconds=1)).isoformat()
    assert await _audit(api.client, since=later) == []
    assert len(await _audit(api.client, until=later)) == len(log)


async def test_who_reads_what(api: ApiHarness) -> None:
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    b_admin = await _key(api, user="bea", project="other", role="admin")
    editor = await _key(api, user="ed", project="default", role="editor")
    async with api.as_key(b_admin) as bea:
        r = await bea.post("/v1/projects/other/volumes", json={"name": "data", "size_tib": 1})
        assert r.status_code in (201, 202), r.text
        # Bea administers "other" only: she reads its records, not default's.
        hers = await _audit(bea)
        assert hers and {e["project"] for e in hers} == {"other"}
        assert any(e["object"] == "volumes/data" and e["user"] == "bea" for e in hers)
        assert await _audit(bea, project="other") == hers
        denied = await bea.get("/v1/audit", params={"project": "default"})
        assert denied.status_code == 404, denied.text
    async with api.as_key(editor) as ed:
        r = await ed.get("/v1/audit")
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
    # The organization admin reads everything, both projects' included.
    everything = await _audit(api.client)
    assert {"other", "default"} <= {e["project"] for e in everything}
    assert any(e["action"] == "create_api_key" and e["object"] == "api-keys/bea"
               for e in everything)  # fmt: skip


async def test_pages_and_bad_filters(api: ApiHarness) -> None:
    for i in range(5):
        await api.client.post("/v1/ssh-keys", json={"name": f"k{i}", "public_key": "nope"})
    first = await api.client.get("/v1/audit", params={"limit": 2})
    assert first.status_code == 200 and len(first.json()) == 2
    cursor = first.headers["X-Next-Cursor"]
    second = await api.client.get("/v1/audit", params={"limit": 2, "cursor": cursor})
    assert second.status_code == 200
    assert not {e["timestamp"] + e["object"] for e in first.json()} & {
        e["timestamp"] + e["object"] for e in second.json()
    }
    now = datetime.now(UTC)
    r = await api.client.get(
        "/v1/audit",
        params={"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()},
    )
    assert r.status_code == 422 and r.json()["field"] == "since"


async def test_console_actions_are_recorded(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "aud3", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201
    await api.wait_cluster("aud3", {"ready"})
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as browser:
        assert (await browser.post("/login", data={"api_key": "wrong"})).status_code == 401
        assert (await browser.post("/login", data={"api_key": api.admin_key})).status_code == 303
        page = (await browser.get("/projects/default/clusters/aud3")).text
        csrf = page.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]
        # Refused by the form's rules: the console sends it back with the reason.
        back = await browser.post(
            "/projects/default/clusters/aud3/scale",
            data={"csrf_token": csrf, "num_gpus": "7"},
        )
        assert back.status_code == 303 and "error=" in back.headers["location"]
        ok = await browser.post(
            "/projects/default/clusters/aud3/scale",
            data={"csrf_token": csrf, "num_gpus": "16"},
        )
        assert ok.status_code == 303 and "error=" not in ok.headers["location"]
    await asyncio.sleep(0)  # the record is written after the answer
    console = [e for e in await _audit(api.client) if e["via"] == "console"]
    admin = await _admin_name(api)
    assert [(e["action"], e["user"], e["object"], e["outcome"]) for e in console] == [
        ("scale_cluster", admin, "clusters/aud3/scale", "ok"),
        ("scale_cluster", admin, "clusters/aud3/scale", "refused"),
        ("login", admin, "login", "ok"),
        ("login", "", "login", "refused"),
    ]
    assert "num_gpus" in console[1]["detail"]
