"""``POST /v1/projects/{project}/clusters/{name}/credentials``.

The fake provider's no-op layer has no Kubernetes and must refuse; the
route's own behaviour (who gets what, the admin flag, context renaming, the
readiness gate, errors) is checked with a test-only layer that issues real
certificates with the cluster PKI and renders them with ``core.kubeconfig``.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from gpuclusters.core import kubeconfig
from gpuclusters.core.enums import ClusterType
from gpuclusters.layers.base import ClusterRef, LayerError
from gpuclusters.layers.kubernetes import pki
from gpuclusters.layers.noop.layer import NoopLayer
from support.api import ApiHarness

P = "/v1/projects/default"
SERVER = "https://127.0.0.1:6443"
ADMIN_GROUP = "system:masters"


@dataclass
class StubCredentialsLayer(NoopLayer):
    """Fake nodes, but a real kubeconfig: what the Kubernetes layer will hand
    out (context named after the cluster, client certificate from the
    cluster CA, admins in ``system:masters``)."""

    ca: pki.KeyPair = field(default_factory=lambda: pki.new_ca("stub-ca"))
    calls: list[tuple[str, str, bool]] = field(default_factory=list)
    stuck: set[str] = field(default_factory=set)  # clusters whose control plane never comes up
    fail_with: LayerError | None = None
    projects: list[str] = field(default_factory=list)  # the project each call named

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        return cluster.name not in self.stuck

    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        self.calls.append((cluster.name, user, admin))
        self.projects.append(project)
        if self.fail_with is not None:
            raise self.fail_with
        leaf = pki.issue(
            self.ca, user, organizations=[ADMIN_GROUP] if admin else [], client=True, days=1
        )
        return kubeconfig.dump(
            kubeconfig.render(
                cluster_name=cluster.name,
                server=SERVER,
                ca_pem=self.ca.cert,
                user_name=user,
                client_cert_pem=leaf.cert,
                client_key_pem=leaf.key,
            )
        )


@pytest.fixture
def stub(api: ApiHarness) -> StubCredentialsLayer:
    layer = StubCredentialsLayer()
    api.runtime.layers[ClusterType.KUBERNETES] = layer
    return layer


async def _ready_cluster(api: ApiHarness, name: str = "demo", kind: str = "kubernetes") -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": name, "cluster_type": kind, "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    ready = await api.wait_cluster(name, {"ready", "failed"})
    assert ready["status"] == "ready"


async def _key(api: ApiHarness, *, user: str, role: str, project: str = "default") -> str:
    r = await api.client.post("/v1/api-keys", json={"user": user, "project": project, "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def _client_cert(config: dict[str, Any], user_entry: str) -> x509.Certificate:
    data = kubeconfig.entry_data(config, "users", user_entry)["client-certificate-data"]
    return x509.load_pem_x509_certificate(base64.b64decode(data))


async def test_fake_provider_has_no_kubernetes_to_give_credentials_for(api: ApiHarness) -> None:
    await _ready_cluster(api)

    r = await api.client.post(f"{P}/clusters/demo/credentials")

    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == "invalid_state"
    assert "cluster demo has no Kubernetes control plane on this provider" in body["message"]


async def test_admin_gets_a_kubeconfig_as_cluster_admin(
    api: ApiHarness, stub: StubCredentialsLayer, caplog: pytest.LogCaptureFixture
) -> None:
    await _ready_cluster(api)

    with caplog.at_level(logging.INFO, logger="gpuclusters.server.services.credentials"):
        r = await api.client.post(f"{P}/clusters/demo/credentials")

    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["cluster"], body["context"], body["user"]) == ("demo", "demo", "admin")
    assert stub.calls == [("demo", "admin", True)]
    assert stub.projects == ["default"]  # named in kubeconfigs that ask for tokens
    config = kubeconfig.load(body["kubeconfig"])
    assert config["current-context"] == "demo"
    assert kubeconfig.entry_data(config, "clusters", "demo")["server"] == SERVER
    cert = _client_cert(config, "admin@demo")
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(stub.ca.cert))
    assert pki.cert_subject(cert.public_bytes(Encoding.PEM)) == ("admin", (ADMIN_GROUP,))
    # The audit line names who and which cluster, never key material.
    audit = [rec.getMessage() for rec in caplog.records if "issued kubeconfig" in rec.getMessage()]
    assert len(audit) == 1
    assert "user=admin" in audit[0] and "cluster=demo" in audit[0] and "role=admin" in audit[0]
    key_data = kubeconfig.entry_data(config, "users", "admin@demo")["client-key-data"]
    assert all(key_data not in rec.getMessage() for rec in caplog.records)
    assert all("PRIVATE KEY" not in rec.getMessage() for rec in caplog.records)


async def test_editor_gets_own_plain_user_credentials(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    await _ready_cluster(api)
    alice = await _key(api, user="alice", role="editor")

    async with api.as_key(alice) as c:
        r = await c.post(f"{P}/clusters/demo/credentials")

    assert r.status_code == 200, r.text
    assert r.json()["user"] == "alice"
    assert stub.calls == [("demo", "alice", False)]
    config = kubeconfig.load(r.json()["kubeconfig"])
    assert config["contexts"][0]["context"]["user"] == "alice@demo"
    cert = _client_cert(config, "alice@demo")
    assert pki.cert_subject(cert.public_bytes(Encoding.PEM)) == ("alice", ())


async def test_project_admin_who_is_not_org_admin_is_admin(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    await _ready_cluster(api)
    bob = await _key(api, user="bob", role="admin")

    async with api.as_key(bob) as c:
        r = await c.post(f"{P}/clusters/demo/credentials", json={})

    assert r.status_code == 200, r.text
    assert stub.calls == [("demo", "bob", True)]


async def test_context_name_renames_context_cluster_and_user_entries(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    await _ready_cluster(api)

    r = await api.client.post(f"{P}/clusters/demo/credentials", json={"context_name": "lab-demo"})

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["context"] == "lab-demo" and body["cluster"] == "demo"
    config = kubeconfig.load(body["kubeconfig"])
    assert config["current-context"] == "lab-demo"
    assert config["contexts"] == [
        {"name": "lab-demo", "context": {"cluster": "lab-demo", "user": "admin@lab-demo"}}
    ]
    assert [c["name"] for c in config["clusters"]] == ["lab-demo"]
    _client_cert(config, "admin@lab-demo")

    r = await api.client.post(f"{P}/clusters/demo/credentials", json={"context_name": None})
    assert r.status_code == 200 and r.json()["context"] == "demo"


@pytest.mark.parametrize("bad", ["", "has space", "-dash", "x" * 254, "a\nb", "ab\n"])
async def test_bad_context_names_are_invalid_input(api: ApiHarness, bad: str) -> None:
    r = await api.client.post(f"{P}/clusters/demo/credentials", json={"context_name": bad})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_input" and r.json()["field"] == "context_name"


async def test_unknown_cluster_and_foreign_project_are_not_found(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    r = await api.client.post(f"{P}/clusters/nope/credentials")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert "nope" in r.json()["message"]

    await _ready_cluster(api)
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    outsider = await _key(api, user="mallory", role="admin", project="other")
    async with api.as_key(outsider) as c:
        r = await c.post(f"{P}/clusters/demo/credentials")
    assert r.status_code == 404 and r.json()["field"] == "project"
    assert stub.calls == []


async def test_cluster_that_is_not_ready_is_invalid_state(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    stub.stuck.add("stuck")
    r = await api.client.post(
        f"{P}/clusters", json={"name": "stuck", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("stuck", {"waiting_for_control_plane"})

    r = await api.client.post(f"{P}/clusters/stuck/credentials")

    assert r.status_code == 409, r.text
    assert r.json()["code"] == "invalid_state"
    assert "stuck is waiting_for_control_plane, not ready" in r.json()["message"]
    assert stub.calls == []


async def test_transient_layer_failure_is_invalid_state(
    api: ApiHarness, stub: StubCredentialsLayer
) -> None:
    await _ready_cluster(api)
    stub.fail_with = LayerError("apiserver not answering")

    r = await api.client.post(f"{P}/clusters/demo/credentials")

    assert r.status_code == 409, r.text
    assert "apiserver not answering" in r.json()["message"]
    assert "try again" in r.json()["message"]


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"null", 409),  # no options: the fake provider's answer
        (b"[]", 422),
        (b'"lab"', 422),
        (b'{"context_name": 5}', 422),
        (b'{"context": "x"}', 422),
        (b"{not json", 422),
    ],
)
async def test_odd_bodies_never_produce_server_errors(
    api: ApiHarness, content: bytes, status: int
) -> None:
    await _ready_cluster(api)
    r = await api.client.post(
        f"{P}/clusters/demo/credentials",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert set(r.json()) == {"code", "message", "field"}
