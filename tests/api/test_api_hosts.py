"""Hosts with host agents through the HTTP API (fake provider; docs/hosts.md):
join tokens for org admins only, joining with a one-use token and a CSR,
heartbeats with the host secret, the inventory feeding placement, a silent
host becoming unreachable (and getting nothing new), drain and removal.

The fleet file holds one host (``h0``), so whether the agent host counts is
visible in ``/v1/gpu-types`` and in whether a two-node cluster fits. The fake
provider cannot make nodes on agent hosts (they are not in its fleet): a node
placed there fails, which is enough to hold the host."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from sqlalchemy import select, update

from gpuclusters.providers.hosts.provider import HostEndpoint
from gpuclusters.server.controllers.housekeeping import sweep_unreachable_hosts
from gpuclusters.server.db.hosts import DbHostDirectory
from gpuclusters.server.db.models import Host, HostJoinToken, Node, utcnow
from gpuclusters.server.security.keys import hash_key
from support.api import ApiHarness

P = "/v1/projects/default"
AGENT = "gpu-a1"
ADDRESS = "10.9.8.7"
H100_8 = {"gpu_model": "H100_SXM", "gpu_count": 8, "nvme_gib": 100.0}


@pytest.fixture
def settings_overrides(tmp_path: Path) -> Iterator[dict[str, Any]]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "hosts:\n  - {name: h0, gpu_type: H100_SXM, region: local-1, ib_island: ib-0}\n"
    )
    # Housekeeping runs once at start and then not again during a test, so
    # the tests decide when silent hosts are swept.
    yield {"fleet_file": fleet, "housekeeping_interval_s": 3600.0}


@pytest.fixture
async def anon(api: ApiHarness) -> AsyncIterator[httpx.AsyncClient]:
    """A client without an API key: what a host agent is."""
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as c:
        yield c


def _csr(address: str = ADDRESS, name: str = AGENT) -> tuple[ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))])
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def _error(r: httpx.Response, status: int, code: str, field: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    if field is not None:
        assert body["field"] == field, body
    return str(body["message"])


async def _token(api: ApiHarness, name: str = AGENT, **extra: Any) -> str:
    r = await api.client.post("/v1/hosts/join-tokens", json={"name": name, **extra})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


async def _join(
    anon: httpx.AsyncClient,
    token: str,
    *,
    name: str = AGENT,
    address: str = ADDRESS,
    inventory: dict[str, Any] | None = None,
    csr_pem: str | None = None,
    port: int = 8471,
) -> httpx.Response:
    return await anon.post(
        "/v1/hosts/join",
        json={
            "token": token,
            "name": name,
            "address": address,
            "port": port,
            "csr_pem": csr_pem if csr_pem is not None else _csr(address, name)[1],
            "inventory": inventory if inventory is not None else {},
        },
    )


async def _joined(
    api: ApiHarness, anon: httpx.AsyncClient, name: str = AGENT, **kw: Any
) -> dict[str, Any]:
    r = await _join(anon, await _token(api, name), name=name, **kw)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def _heartbeat(
    anon: httpx.AsyncClient, secret: str | None, name: str = AGENT, inventory: Any = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    return await anon.post(
        f"/v1/hosts/{name}/heartbeat",
        json={"inventory": inventory if inventory is not None else H100_8},
        headers=headers,
    )


async def _hosts(api: ApiHarness) -> dict[str, dict[str, Any]]:
    r = await api.client.get("/v1/hosts", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return {h["name"]: h for h in r.json()}


async def _free(api: ApiHarness, gpu_type: str) -> tuple[int, int]:
    """(free hosts, total hosts) of ``gpu_type``."""
    types = {t["name"]: t for t in (await api.client.get("/v1/gpu-types")).json()}
    return types[gpu_type]["free_hosts"], types[gpu_type]["total_hosts"]


async def _host_row(api: ApiHarness, name: str) -> Host | None:
    async with api.runtime.sessionmaker() as s:
        return await s.scalar(select(Host).where(Host.name == name))


async def _key(api: ApiHarness, user: str, role: str) -> str:
    r = await api.client.post(
        "/v1/api-keys", json={"user": user, "project": "default", "role": role}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def test_only_org_admins_make_join_tokens(api: ApiHarness) -> None:
    for user, role in (("alice", "editor"), ("bob", "admin")):  # bob: a project admin
        async with api.as_key(await _key(api, user, role)) as c:
            r = await c.post("/v1/hosts/join-tokens", json={"name": AGENT})
            _error(r, 403, "forbidden")
            _error(await c.get("/v1/hosts", params={"limit": 1000}), 403, "forbidden")
            _error(await c.post(f"/v1/hosts/{AGENT}/drain"), 403, "forbidden")
            _error(await c.delete(f"/v1/hosts/{AGENT}"), 403, "forbidden")
    async with api.runtime.sessionmaker() as s:
        assert list(await s.scalars(select(HostJoinToken))) == []

    for bad in ("Gpu_A1", "-gpu", "a" * 64, "gpu a1"):
        r = await api.client.post("/v1/hosts/join-tokens", json={"name": bad})
        _error(r, 422, "invalid_input", "name")
    r = await api.client.post("/v1/hosts/join-tokens", json={"name": AGENT, "ttl_s": 5})
    _error(r, 422, "invalid_input", "ttl_s")
    # A host of the fleet file is not the agents' to claim.
    r = await api.client.post("/v1/hosts/join-tokens", json={"name": "h0"})
    assert "fleet file" in _error(r, 409, "invalid_state", "name")

    before = utcnow()
    r = await api.client.post("/v1/hosts/join-tokens", json={"name": AGENT, "ttl_s": 600})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == AGENT and body["token"].startswith("gpc_")
    # TLS is off in these tests: no URL or CA to hand over.
    assert body["server_url"] is None and body["ca_fingerprint"] is None
    async with api.runtime.sessionmaker() as s:
        row = await s.scalar(select(HostJoinToken).where(HostJoinToken.host_name == AGENT))
    assert row is not None and row.used_at is None
    assert row.token_hash == hash_key(body["token"])  # stored hashed, never in clear
    assert timedelta(seconds=590) < row.expires_at - before < timedelta(seconds=610)
    assert row.ib_island == AGENT and row.region == "local-1"  # the defaults
    # A token alone adds no host.
    assert set(await _hosts(api)) == {"h0"}


async def test_join_with_a_bad_token_changes_nothing(
    api: ApiHarness, anon: httpx.AsyncClient
) -> None:
    _error(await _join(anon, "gpc_" + "x" * 43), 401, "unauthenticated")

    expired = await _token(api)
    async with api.runtime.sessionmaker() as s:
        await s.execute(
            update(HostJoinToken)
            .where(HostJoinToken.token_hash == hash_key(expired))
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        await s.commit()
    _error(await _join(anon, expired), 401, "unauthenticated")

    token = await _token(api)
    # The join endpoint validates what it is sent, naming the field.
    _error(await _join(anon, token, name="Bad_Name"), 422, "invalid_input", "name")
    _error(await _join(anon, token, port=0), 422, "invalid_input", "port")
    # A token names its host: it is no key for another one.
    r = await _join(anon, token, name="gpu-a2")
    assert "gpu-a1" in _error(r, 422, "invalid_input", "name")
    # Not a CSR; and an RSA CSR (agents make EC keys).
    _error(await _join(anon, token, csr_pem="hello"), 422, "invalid_input", "csr_pem")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, AGENT)]))
        .sign(rsa_key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    r = await _join(anon, token, csr_pem=rsa_csr)
    assert "EC key" in _error(r, 422, "invalid_input", "csr_pem")

    assert await _host_row(api, AGENT) is None
    assert await _host_row(api, "gpu-a2") is None
    assert set(await _hosts(api)) == {"h0"}

    # None of the refused attempts used the token up.
    r = await _join(anon, token)
    assert r.status_code == 200, r.text
    secret = r.json()["secret"]
    # Now it is used: a second join with it is refused and changes nothing.
    _error(await _join(anon, token, address="10.0.0.66"), 401, "unauthenticated")
    assert (await _hosts(api))[AGENT]["address"] == ADDRESS
    assert (await _heartbeat(anon, secret)).status_code == 204  # the first secret still holds


async def test_join_signs_the_csr_and_heartbeats_make_the_host_ready(
    api: ApiHarness, anon: httpx.AsyncClient
) -> None:
    token = await _token(api, ib_island="ib-x")
    key, csr_pem = _csr()
    inventory = {"gpu_model": "H200_SXM", "gpu_count": 8, "nvme_gib": 3576.4, "cpus": 96}
    r = await _join(anon, token, csr_pem=csr_pem, inventory=inventory)
    assert r.status_code == 200, r.text
    joined = r.json()
    assert joined["name"] == AGENT and joined["secret"].startswith("gpc_")

    # The certificate: for our key, signed by the hosts CA, valid for the address.
    pki_dir = api.settings.home / "hosts-pki"
    hosts_ca = x509.load_pem_x509_certificate((pki_dir / "hosts-ca.crt").read_bytes())
    control_ca_pem = (pki_dir / "control-ca.crt").read_bytes()
    cert = x509.load_pem_x509_certificate(joined["certificate_pem"].encode())
    cert.verify_directly_issued_by(hosts_ca)
    assert cert.public_key() == key.public_key()
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ADDRESS)]
    assert sans.get_values_for_type(x509.DNSName) == []
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == AGENT
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    # The control CA the agent will accept callers from, not the hosts CA.
    assert joined["control_ca_pem"].encode() == control_ca_pem
    control_ca = x509.load_pem_x509_certificate(control_ca_pem)
    assert control_ca.subject != hosts_ca.subject
    with pytest.raises((ValueError, TypeError)):
        cert.verify_directly_issued_by(control_ca)

    host = (await _hosts(api))[AGENT]
    assert host["agent_status"] == "joining"
    assert host["address"] == ADDRESS and host["last_heartbeat_at"] is None
    assert (host["gpu_type"], host["num_gpus"], host["nvme_gib"]) == ("H200_SXM", 8, 3576)
    assert host["ib_island"] == "ib-x" and host["region"] == "local-1"
    assert host["state"] == "available" and host["inventory"] == inventory
    # A joining host is counted but not placeable until it heartbeats.
    assert await _free(api, "H200_SXM") == (0, 1)
    row = await _host_row(api, AGENT)
    assert row is not None and row.agent_port == 8471
    assert row.secret_hash == hash_key(joined["secret"])

    # Heartbeats need the host's own secret.
    _error(await _heartbeat(anon, "gpc_wrong", inventory=inventory), 401, "unauthenticated")
    _error(await _heartbeat(anon, None, inventory=inventory), 401, "unauthenticated")
    r = await _heartbeat(anon, joined["secret"], name="h0", inventory=inventory)
    _error(r, 401, "unauthenticated")  # nor is it a key to another host
    _error(await _heartbeat(anon, api.admin_key, inventory=inventory), 401, "unauthenticated")
    assert (await _hosts(api))[AGENT]["agent_status"] == "joining"

    before = utcnow()
    assert (await _heartbeat(anon, joined["secret"], inventory=inventory)).status_code == 204
    host = (await _hosts(api))[AGENT]
    assert host["agent_status"] == "ready"
    assert host["last_heartbeat_at"] is not None
    row = await _host_row(api, AGENT)
    assert row is not None and row.last_heartbeat_at is not None
    assert row.last_heartbeat_at >= before
    assert await _free(api, "H200_SXM") == (1, 1)

    # Each heartbeat's inventory is the host's: a GPU-less host offers the
    # simulated type its agent names (8 GPUs), or H100_SXM without one.
    gpu_less = {"gpu_model": None, "gpu_count": 0, "nvme_gib": 0, "simulated_gpu_type": "B200_SXM"}
    assert (await _heartbeat(anon, joined["secret"], inventory=gpu_less)).status_code == 204
    host = (await _hosts(api))[AGENT]
    assert (host["gpu_type"], host["num_gpus"], host["nvme_gib"]) == ("B200_SXM", 8, 0)
    assert host["inventory"] == gpu_less
    assert await _free(api, "B200_SXM") == (1, 1)
    assert await _free(api, "H200_SXM") == (0, 0)
    assert (await _heartbeat(anon, joined["secret"], inventory={})).status_code == 204
    host = (await _hosts(api))[AGENT]
    assert (host["gpu_type"], host["num_gpus"]) == ("H100_SXM", 8)
    assert await _free(api, "H100_SXM") == (2, 2)

    # The providers' directory of agents (what the hosts provider dials).
    directory = DbHostDirectory(api.runtime.sessionmaker)
    assert await directory.endpoint(AGENT) == HostEndpoint(AGENT, ADDRESS, 8471)
    assert await directory.endpoint("h0") is None  # a fleet-file host has no agent
    assert await directory.endpoint("nope") is None
    assert await directory.endpoints() == [HostEndpoint(AGENT, ADDRESS, 8471)]


async def test_a_silent_host_becomes_unreachable_and_gets_nothing_new(
    api: ApiHarness, anon: httpx.AsyncClient
) -> None:
    joined = await _joined(api, anon, inventory=H100_8)
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204
    # A second host joins but never heartbeats: nothing to time out from.
    await _joined(api, anon, "gpu-a2", address="10.9.8.8", inventory=H100_8)
    assert await _free(api, "H100_SXM") == (2, 3)

    # Within the timeout nothing is swept.
    assert await sweep_unreachable_hosts(api.runtime) == []
    async with api.runtime.sessionmaker() as s:
        await s.execute(
            update(Host)
            .where(Host.name == AGENT)
            .values(
                last_heartbeat_at=utcnow()
                - timedelta(seconds=api.settings.host_agent_timeout_s + 1)
            )
        )
        await s.commit()
    assert await sweep_unreachable_hosts(api.runtime) == [AGENT]
    assert await sweep_unreachable_hosts(api.runtime) == []  # already unreachable
    hosts = await _hosts(api)
    assert hosts[AGENT]["agent_status"] == "unreachable"
    assert hosts["gpu-a2"]["agent_status"] == "joining"
    assert await _free(api, "H100_SXM") == (1, 3)

    # Two nodes need h0 and the agent host: no room while it is silent.
    body = {"name": "two", "cluster_type": "kubernetes", "num_gpus": 16}
    r = await api.client.post(f"{P}/clusters", json=body)
    assert "1 free" in _error(r, 409, "capacity_unavailable", "num_gpus")
    assert (await api.client.get(f"{P}/clusters/two")).status_code == 404

    # It heartbeats again: ready, and placement uses it.
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204
    assert (await _hosts(api))[AGENT]["agent_status"] == "ready"
    assert await _free(api, "H100_SXM") == (2, 3)
    r = await api.client.post(f"{P}/clusters", json=body)
    assert r.status_code == 201, r.text
    assert sorted(n["host"] for n in r.json()["nodes"]) == [AGENT, "h0"]

    # A host that holds a node is neither removed nor given a new token.
    msg = _error(await api.client.delete(f"/v1/hosts/{AGENT}"), 409, "invalid_state", "name")
    assert "drain" in msg
    r = await api.client.post("/v1/hosts/join-tokens", json={"name": AGENT})
    _error(r, 409, "invalid_state", "name")
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204

    # Once the cluster is gone the empty host can be removed.
    assert (await api.client.delete(f"{P}/clusters/two")).status_code in (200, 202)
    await api.wait_cluster("two", {"gone"}, within_s=30)
    async with api.runtime.sessionmaker() as s:
        live = await s.scalar(
            select(Node.name)
            .join(Host, Host.id == Node.host_id)
            .where(Host.name == AGENT, Node.deleted_at.is_(None))
        )
    assert live is None
    r = await api.client.delete(f"/v1/hosts/{AGENT}")
    assert r.status_code == 200, r.text
    assert r.json()["name"] == AGENT and r.json()["agent_status"] == "removed"
    hosts = await _hosts(api)
    assert AGENT not in hosts and set(hosts) == {"h0", "gpu-a2"}
    _error(await _heartbeat(anon, joined["secret"]), 401, "unauthenticated")
    assert await _free(api, "H100_SXM") == (1, 2)
    directory = DbHostDirectory(api.runtime.sessionmaker)
    assert [ep.name for ep in await directory.endpoints()] == ["gpu-a2"]
    _error(await api.client.post(f"/v1/hosts/{AGENT}/drain"), 404, "not_found", "name")

    # A removed host may join again, with a new token and a new secret.
    again = await _joined(api, anon, inventory=H100_8)
    assert again["secret"] != joined["secret"]
    _error(await _heartbeat(anon, joined["secret"]), 401, "unauthenticated")
    assert (await _heartbeat(anon, again["secret"])).status_code == 204
    assert (await _hosts(api))[AGENT]["agent_status"] == "ready"


async def test_drain_cordons_an_agent_host(api: ApiHarness, anon: httpx.AsyncClient) -> None:
    joined = await _joined(api, anon, inventory=H100_8)
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204
    assert await _free(api, "H100_SXM") == (2, 2)

    r = await api.client.post(f"/v1/hosts/{AGENT}/drain")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cordoned" and r.json()["agent_status"] == "ready"
    assert (await _hosts(api))[AGENT]["state"] == "cordoned"
    assert await _free(api, "H100_SXM") == (1, 2)
    # Idempotent; and a heartbeat does not undo the cordon.
    assert (await api.client.post(f"/v1/hosts/{AGENT}/drain")).status_code == 200
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204
    assert (await _hosts(api))[AGENT]["state"] == "cordoned"
    body = {"name": "two", "cluster_type": "kubernetes", "num_gpus": 16}
    _error(await api.client.post(f"{P}/clusters", json=body), 409, "capacity_unavailable")

    r = await api.client.post(f"/v1/hosts/{AGENT}/uncordon")
    assert r.status_code == 200 and r.json()["state"] == "available"
    assert await _free(api, "H100_SXM") == (2, 2)
    _error(await api.client.post("/v1/hosts/nope/drain"), 404, "not_found", "name")


async def test_fleet_file_hosts_are_not_removed_through_the_api(api: ApiHarness) -> None:
    msg = _error(await api.client.delete("/v1/hosts/h0"), 409, "invalid_state", "name")
    assert "fleet file" in msg
    _error(await api.client.delete("/v1/hosts/nope"), 404, "not_found", "name")
    assert (await _hosts(api))["h0"]["agent_status"] is None
    row = await _host_row(api, "h0")
    assert row is not None and row.in_fleet and row.agent_status is None
    assert json.loads(row.inventory or "null") is None


async def test_a_token_is_used_once_even_by_concurrent_joins(
    api: ApiHarness, anon: httpx.AsyncClient
) -> None:
    await _joined(api, anon, inventory=H100_8)  # the host row exists: a re-join
    token = await _token(api)
    answers = await asyncio.gather(
        _join(anon, token, address="10.9.8.21"), _join(anon, token, address="10.9.8.22")
    )
    assert sorted(r.status_code for r in answers) == [200, 401], [r.text for r in answers]


async def test_a_host_gone_for_good_is_removed_with_force_and_its_cluster_deleted(
    api: ApiHarness, anon: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined = await _joined(api, anon, inventory=H100_8)
    assert (await _heartbeat(anon, joined["secret"])).status_code == 204
    body = {"name": "two", "cluster_type": "kubernetes", "num_gpus": 16}
    assert (await api.client.post(f"{P}/clusters", json=body)).status_code == 201
    # (The fake provider of these tests has no agent hosts: the node placed
    # there fails, as one on a host that died would.)
    await api.wait_cluster("two", {"failed"})
    nodes = {n["host"]: n["name"] for n in (await api.client.get(f"{P}/nodes")).json()}
    lost = nodes[AGENT]

    # Forcing needs a reason, and an organization admin; refusals change nothing.
    url = f"/v1/hosts/{AGENT}"
    _error(await api.client.delete(url, params={"force": "true"}), 422, "invalid_input", "reason")
    _error(await api.client.delete(url, params={"reason": "x"}), 422, "invalid_input", "reason")
    member = await _key(api, "carol", "admin")
    async with api.as_key(member) as c:
        r = await c.delete(url, params={"force": "true", "reason": "disk died"})
    _error(r, 403, "forbidden")
    assert (await _hosts(api))[AGENT]["agent_status"] == "ready"

    r = await api.client.delete(url, params={"force": "true", "reason": "motherboard died"})
    assert r.status_code == 200, r.text
    assert r.json()["agent_status"] == "removed"
    assert AGENT not in await _hosts(api)
    events = (await api.client.get(f"{P}/events", params={"node": lost})).json()
    assert f"host {AGENT} removed by admin: motherboard died" in [e["message"] for e in events]

    # Its agent is gone: deleting the node's instance fails, and is skipped
    # (the host is gone for good), so the cluster's delete finishes.
    provider = api.runtime.provider
    real_delete = provider.delete

    async def delete(node_id: str) -> None:
        async with api.runtime.sessionmaker() as s:
            name = await s.scalar(select(Node.name).where(Node.id == node_id))
        if name == lost:
            from gpuclusters.providers.base import ProviderError

            raise ProviderError(f"host agent {AGENT}: connection refused")
        await real_delete(node_id)

    monkeypatch.setattr(provider, "delete", delete)
    assert (await api.client.delete(f"{P}/clusters/two")).status_code == 202
    await api.wait_cluster("two", {"gone"}, within_s=30)
    events = (await api.client.get(f"{P}/events", params={"node": lost})).json()
    skipped = [e["message"] for e in events if e["reason"] == "StepSkipped"]
    assert any(f"host {AGENT} was removed" in m and "connection refused" in m for m in skipped), (
        events
    )
