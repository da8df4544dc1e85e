"""The server as the issuer of users' Kubernetes tokens (security/
cluster_tokens.py): its discovery document and keys, public; the token
route's refusals. Tokens an apiserver accepts are tested on a real cluster
(tests/e2e/test_kubernetes_cluster.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from support.api import ApiHarness

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"tls": "on", "public_host": "gw.example"}


async def test_discovery_and_keys_are_public(api: ApiHarness) -> None:
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as anonymous:
        doc = (await anonymous.get("/.well-known/openid-configuration")).json()
        assert doc["issuer"] == api.settings.tls_url
        assert doc["jwks_uri"] == "http://testserver/v1/oidc/jwks"
        keys = (await anonymous.get("/v1/oidc/jwks")).json()["keys"]
        assert [k["kty"] for k in keys] == ["EC"] and "d" not in keys[0]  # no private part


async def test_tokens_need_a_member_and_a_listener_nodes_reach(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "t1", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("t1", {"ready"})
    # The fake provider's server runs no registry listener: no apiserver
    # could read the keys, so no token is signed, and the reason is said.
    refused = await api.client.post(f"{P}/clusters/t1/token")
    assert refused.status_code == 409 and "token listener" in refused.json()["message"]
    assert (await api.client.post(f"{P}/clusters/nope/token")).status_code == 404
    r = await api.client.post("/v1/projects", json={"name": "other"})
    assert r.status_code == 201
    key = (
        await api.client.post(
            "/v1/api-keys", json={"user": "eve", "project": "other", "role": "admin"}
        )
    ).json()["key"]
    async with api.as_key(key) as eve:
        assert (await eve.post(f"{P}/clusters/t1/token")).status_code == 404
