"""``GET /v1/registry/token``: the registry's token endpoint (Docker token
protocol) through the real application. Users authenticate with their user
name and API key, a cluster's nodes with the cluster's pull credential; a
token grants exactly the allowed part of what was asked, and another
project's repositories get nothing. The registry process itself is not
started here (``registry="off"`` runs none): the runtime's registry part is
made directly, as the lifespan does when it runs one."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import jwt
import pytest

from gpuclusters.server.registry_daemon import RegistryRuntime
from gpuclusters.server.security.registry_tokens import SERVICE, ensure_registry_keys
from support.api import ApiHarness

TOKEN = "/v1/registry/token"


def basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


@pytest.fixture
def registry(api: ApiHarness) -> Iterator[RegistryRuntime]:
    keys = ensure_registry_keys(api.settings.home)
    rt = api.runtime
    # No process to stop: the lifespan's shutdown must find none.
    rt.registry = RegistryRuntime(keys=keys, daemon=None, ca_pem=None)  # type: ignore[arg-type]
    try:
        yield rt.registry
    finally:
        rt.registry = None


def access_of(api: ApiHarness, registry: RegistryRuntime, body: dict[str, Any]) -> list[Any]:
    (jwk,) = json.loads(registry.keys.jwks_file.read_text())["keys"]
    claims = jwt.decode(body["token"], jwt.PyJWK(jwk).key, algorithms=["ES256"], audience=SERVICE)
    assert body["access_token"] == body["token"]
    assert body["expires_in"] > 0
    return list(claims["access"])


async def token(
    api: ApiHarness, headers: dict[str, str], *scopes: str
) -> tuple[int, dict[str, Any]]:
    params = [("service", SERVICE), *(("scope", s) for s in scopes)]
    r = await api.client.get(TOKEN, params=params, headers=headers)
    return r.status_code, r.json()


async def test_no_registry_is_not_found(api: ApiHarness) -> None:
    r = await api.client.get(TOKEN, headers=basic("admin", api.admin_key))
    assert r.status_code == 404
    assert r.json()["code"] == "not_found"


async def test_users_get_their_projects_and_nothing_of_others(
    api: ApiHarness, registry: RegistryRuntime
) -> None:
    # A second project with an editor who is not in "default".
    r = await api.client.post("/v1/projects", json={"name": "vision"})
    assert r.status_code == 201, r.text
    r = await api.client.post(
        "/v1/api-keys", json={"user": "bob", "project": "vision", "role": "editor"}
    )
    assert r.status_code == 201, r.text
    bob_key = r.json()["key"]

    status, body = await token(
        api, basic("bob", bob_key), "repository:vision/train:pull,push", "repository:default/x:pull"
    )
    assert status == 200
    assert access_of(api, registry, body) == [
        {"type": "repository", "name": "vision/train", "actions": ["pull", "push"]}
    ]
    # System images: pull only.
    status, body = await token(api, basic("bob", bob_key), "repository:kueue:pull,push")
    assert access_of(api, registry, body) == [
        {"type": "repository", "name": "kueue", "actions": ["pull"]}
    ]
    # The organization admin acts in every existing project, not in made-up ones.
    status, body = await token(
        api,
        basic("admin", api.admin_key),
        "repository:vision/train:push",
        "repository:nosuch/x:pull",
    )
    assert access_of(api, registry, body) == [
        {"type": "repository", "name": "vision/train", "actions": ["push"]}
    ]


async def test_wrong_credentials_are_refused(api: ApiHarness, registry: RegistryRuntime) -> None:
    status, body = await token(api, basic("admin", "gpc_not_a_key"), "repository:default/x:pull")
    assert status == 401
    assert body["code"] == "unauthenticated"
    # The right key under another user's name is refused too, saying why.
    status, body = await token(api, basic("bob", api.admin_key), "repository:default/x:pull")
    assert status == 401
    assert "admin" in body["message"]
    r = await api.client.get(TOKEN, headers={"Authorization": "Basic !!!"})
    assert r.status_code == 401


async def test_anonymous_gets_a_token_without_project_grants(
    api: ApiHarness, registry: RegistryRuntime
) -> None:
    r = await api.client.get(
        TOKEN, params={"scope": "repository:default/x:pull"}, headers={"Authorization": ""}
    )
    assert r.status_code == 200
    assert access_of(api, registry, r.json()) == []


async def test_cluster_pull_credentials_pull_their_project_only(
    api: ApiHarness, registry: RegistryRuntime
) -> None:
    r = await api.client.post(
        "/v1/projects/default/clusters",
        json={"name": "c1", "cluster_type": "kubernetes", "num_gpus": 8},
    )
    assert r.status_code == 201, r.text
    cluster = await api.wait_cluster("c1", {"ready"})
    assert cluster["registry"] == f"{api.settings.registry_address}/default"
    cluster_id = await _cluster_id(api, "c1")
    user, password = registry.keys.cluster_credential(cluster_id)
    status, body = await token(
        api, basic(user, password), "repository:default/app:pull,push", "repository:vision/app:pull"
    )
    assert status == 200
    assert access_of(api, registry, body) == [
        {"type": "repository", "name": "default/app", "actions": ["pull"]}
    ]
    # A deleted cluster's credential stops working.
    r = await api.client.delete("/v1/projects/default/clusters/c1")
    assert r.status_code == 202
    await api.wait_cluster("c1", {"deleted", "gone"})
    status, body = await token(api, basic(user, password), "repository:default/app:pull")
    assert status == 401


async def _cluster_id(api: ApiHarness, name: str) -> str:
    from sqlalchemy import select

    from gpuclusters.server.db.models import Cluster

    async with api.runtime.sessionmaker() as session:
        return str(
            await session.scalar(
                select(Cluster.id).where(Cluster.name == name, Cluster.deleted_at.is_(None))
            )
        )
