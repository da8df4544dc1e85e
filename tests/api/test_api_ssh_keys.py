"""SSH keys (``/v1/ssh-keys``), the organization's SSH CAs (``/v1/ssh-ca``)
and user certificates (``POST .../clusters/{name}/ssh-certificate``).

Certificates are checked with ``core.sshca.inspect_certificate`` and with
OpenSSH's own ``ssh-keygen -L``; the known_hosts line with ``ssh-keygen
-F`` on a non-22 port. The fake provider has no gateway, so tests give the
cluster its SSH port in the database.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import func, select

from gpuclusters.core import sshca
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.models import (
    Cluster,
    Node,
    Organization,
    SshAuthority,
    SshKey,
    User,
)
from gpuclusters.server.db.ssh import org_authority
from support.api import ApiHarness

P = "/v1/projects/default"
GATEWAY = "gw.example.test"
SSH_PORT = 30022

needs_ssh_keygen = pytest.mark.skipif(
    shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen"
)


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"public_host": GATEWAY}


def ssh_keygen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh-keygen", *args], capture_output=True, text=True)


def new_pub(comment: str = "") -> str:
    return sshca.new_keypair(comment).public_openssh


async def _user_key(api: ApiHarness, user: str, project: str = "default") -> str:
    r = await api.client.post(
        "/v1/api-keys", json={"user": user, "project": project, "role": "editor"}
    )
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


async def _ready_cluster(
    api: ApiHarness, name: str = "demo", *, port: int | None = SSH_PORT
) -> int:
    r = await api.client.post(
        f"{P}/clusters", json={"name": name, "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster(name, {"ready"})
    async with api.runtime.sessionmaker() as s:
        cluster = (await s.scalars(select(Cluster).where(Cluster.name == name))).one()
        if port is None:
            cluster.ssh_port = None
        elif cluster.ssh_port is None:  # no gateway on the fake provider
            cluster.ssh_port = port
        await s.commit()
        return cluster.ssh_port or 0


# --- keys --------------------------------------------------------------------------------


async def test_add_list_delete(api: ApiHarness) -> None:
    pub = new_pub("alice@laptop")
    before = api.runtime.hints.count(hints.ACCESS)
    r = await api.client.post("/v1/ssh-keys", json={"public_key": pub})
    assert r.status_code == 201, r.text
    key = r.json()
    assert set(key) == {"id", "name", "key_type", "fingerprint", "public_key", "created_at"}
    assert key["name"] == "alice@laptop"  # the comment
    assert key["key_type"] == "ssh-ed25519"
    assert key["public_key"] == " ".join(pub.split()[:2])  # stored without the comment
    assert key["fingerprint"] == sshca.fingerprint(pub)
    assert api.runtime.hints.count(hints.ACCESS) == before + 1

    named = await api.client.post("/v1/ssh-keys", json={"public_key": new_pub(), "name": " ci "})
    assert named.status_code == 201 and named.json()["name"] == "ci"

    listed = (await api.client.get("/v1/ssh-keys")).json()
    assert [k["id"] for k in listed] == [key["id"], named.json()["id"]]

    assert (await api.client.delete(f"/v1/ssh-keys/{key['id']}")).status_code == 204
    assert api.runtime.hints.count(hints.ACCESS) == before + 3
    assert [k["id"] for k in (await api.client.get("/v1/ssh-keys")).json()] == [named.json()["id"]]
    again = await api.client.delete(f"/v1/ssh-keys/{key['id']}")
    assert again.status_code == 404 and again.json()["code"] == "not_found"
    async with api.runtime.sessionmaker() as s:
        row = await s.get_one(SshKey, key["id"])
        assert row.deleted_at is not None  # kept, marked deleted
    # A deleted key may be added again.
    assert (await api.client.post("/v1/ssh-keys", json={"public_key": pub})).status_code == 201


@needs_ssh_keygen
async def test_fingerprint_matches_ssh_keygen_and_deletes_the_key(
    api: ApiHarness, tmp_path: Path
) -> None:
    # A fingerprint is base64: find a key whose fingerprint holds a "/".
    pub = next(p for p in (new_pub("x") for _ in range(200)) if "/" in sshca.fingerprint(p))
    (tmp_path / "k.pub").write_text(pub + "\n")
    shown = ssh_keygen("-l", "-E", "sha256", "-f", str(tmp_path / "k.pub")).stdout.split()[1]
    key = (await api.client.post("/v1/ssh-keys", json={"public_key": pub})).json()
    assert key["fingerprint"] == shown
    r = await api.client.delete(f"/v1/ssh-keys/{quote(shown, safe='')}")
    assert r.status_code == 204, r.text
    assert (await api.client.get("/v1/ssh-keys")).json() == []


async def test_delete_by_fingerprint_without_prefix(api: ApiHarness) -> None:
    pub = next(p for p in (new_pub() for _ in range(200)) if "/" not in sshca.fingerprint(p))
    await api.client.post("/v1/ssh-keys", json={"public_key": pub})
    bare = sshca.fingerprint(pub).removeprefix("SHA256:")
    assert (await api.client.delete(f"/v1/ssh-keys/{bare}")).status_code == 204


def _rsa_pub(bits: int) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


@pytest.mark.parametrize(
    ("public_key", "rule"),
    [
        ("", "empty"),
        ("ssh-ed25519", "expected '<type> <base64 key> [comment]'"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "not accepted"),
        ("ssh-ed25519 not*base64", "not a valid ssh-ed25519 public key"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n", "private key"),
        ("ssh-ed25519-cert-v01@openssh.com AAAA", "certificate"),
        (f"{new_pub()}\n{new_pub()}", "one line"),
    ],
)
async def test_bad_keys_name_the_field_and_the_rule(
    api: ApiHarness, public_key: str, rule: str
) -> None:
    r = await api.client.post("/v1/ssh-keys", json={"public_key": public_key})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "invalid_input" and body["field"] == "public_key"
    assert rule in body["message"] and body["message"].startswith("public_key: ")
    assert (await api.client.get("/v1/ssh-keys")).json() == []


async def test_short_rsa_keys_and_missing_fields(api: ApiHarness) -> None:
    r = await api.client.post("/v1/ssh-keys", json={"public_key": _rsa_pub(1024)})
    assert r.status_code == 422 and r.json()["field"] == "public_key"
    assert "at least 2048 bits" in r.json()["message"]
    ok = await api.client.post("/v1/ssh-keys", json={"public_key": _rsa_pub(2048)})
    assert ok.status_code == 201 and ok.json()["key_type"] == "ssh-rsa"
    r = await api.client.post("/v1/ssh-keys", json={})
    assert r.status_code == 422 and r.json()["field"] == "public_key"
    r = await api.client.post("/v1/ssh-keys", json={"public_key": new_pub(), "name": "a\tb"})
    assert r.status_code == 422 and r.json()["field"] == "name"
    r = await api.client.post("/v1/ssh-keys", json={"public_key": new_pub(), "extra": 1})
    assert r.status_code == 422 and r.json()["field"] == "extra"


async def test_the_same_key_twice_is_already_exists(api: ApiHarness) -> None:
    pub = new_pub("one")
    assert (await api.client.post("/v1/ssh-keys", json={"public_key": pub})).status_code == 201
    # The same key with another comment is the same key.
    again = " ".join(pub.split()[:2]) + " two"
    r = await api.client.post("/v1/ssh-keys", json={"public_key": again})
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "already_exists" and r.json()["field"] == "public_key"
    # Concurrent adds of one key: one wins, the others are already_exists.
    other = new_pub()
    results = await asyncio.gather(
        *(api.client.post("/v1/ssh-keys", json={"public_key": other}) for _ in range(4))
    )
    assert sorted(r.status_code for r in results) == [201, 409, 409, 409]
    # Another user may register the same public key for themselves.
    async with api.as_key(await _user_key(api, "alice")) as alice:
        assert (await alice.post("/v1/ssh-keys", json={"public_key": pub})).status_code == 201


async def test_other_users_keys_are_invisible(api: ApiHarness) -> None:
    mine = (await api.client.post("/v1/ssh-keys", json={"public_key": new_pub()})).json()
    async with api.as_key(await _user_key(api, "alice")) as alice:
        assert (await alice.get("/v1/ssh-keys")).json() == []
        r = await alice.delete(f"/v1/ssh-keys/{mine['id']}")
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = await alice.delete(f"/v1/ssh-keys/{quote(mine['fingerprint'], safe='')}")
        assert r.status_code == 404
        hers = (await alice.post("/v1/ssh-keys", json={"public_key": new_pub()})).json()
    # Organization admins neither see nor delete others' keys.
    assert [k["id"] for k in (await api.client.get("/v1/ssh-keys")).json()] == [mine["id"]]
    assert (await api.client.delete(f"/v1/ssh-keys/{hers['id']}")).status_code == 404
    assert (await api.client.get("/v1/ssh-keys", headers={"Authorization": ""})).status_code == 401


# --- certificate authorities -------------------------------------------------------------


@needs_ssh_keygen
async def test_ssh_ca_and_its_known_hosts_line(api: ApiHarness, tmp_path: Path) -> None:
    r = await api.client.get("/v1/ssh-ca")
    assert r.status_code == 200, r.text
    ca = r.json()
    assert set(ca) == {"user_ca_public_key", "host_ca_public_key", "gateway_host", "known_hosts"}
    assert ca["gateway_host"] == GATEWAY
    assert ca["user_ca_public_key"].startswith("ssh-ed25519 ")
    assert ca["host_ca_public_key"].startswith("ssh-ed25519 ")
    assert ca["user_ca_public_key"] != ca["host_ca_public_key"]
    host_key = " ".join(ca["host_ca_public_key"].split()[:2])
    assert ca["known_hosts"] == (
        f"@cert-authority [{GATEWAY}]:*,{GATEWAY} {host_key} gpuclusters:default"
    )
    # Made once: the same on every call, and for every member of the organization.
    assert (await api.client.get("/v1/ssh-ca")).json() == ca
    async with api.as_key(await _user_key(api, "alice")) as alice:
        assert (await alice.get("/v1/ssh-ca")).json() == ca
    # ssh finds the line for the gateway on any port, and for no other host.
    known = tmp_path / "known_hosts"
    known.write_text(ca["known_hosts"] + "\n")
    for host, found in (
        (f"[{GATEWAY}]:{SSH_PORT}", True),
        (f"[{GATEWAY}]:31999", True),
        (GATEWAY, True),
        (f"[other.example.test]:{SSH_PORT}", False),
        ("other.example.test", False),
    ):
        assert (ssh_keygen("-F", host, "-f", str(known)).returncode == 0) is found, host


async def test_concurrent_first_use_makes_one_ca_per_kind(api: ApiHarness) -> None:
    results = await asyncio.gather(*(api.client.get("/v1/ssh-ca") for _ in range(6)))
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert len({r.json()["host_ca_public_key"] for r in results}) == 1
    assert len({r.json()["user_ca_public_key"] for r in results}) == 1
    async with api.runtime.sessionmaker() as s:
        assert await s.scalar(select(func.count()).select_from(SshAuthority)) == 2


async def test_org_authority_loser_of_a_race_reads_the_winners_ca(
    api: ApiHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two first uses both miss the row and both insert: the loser's insert
    does nothing (ON CONFLICT DO NOTHING), it returns the winner's CA, and
    its own earlier work in the transaction survives."""
    rt = api.runtime
    async with rt.sessionmaker() as s:
        org_id = (await s.scalars(select(Organization.id))).one()
        admin_id = (await s.scalars(select(User.id).where(User.name == "admin"))).one()
    async with rt.sessionmaker() as winner:
        won = await org_authority(winner, org_id, "host")
        await winner.commit()
    async with rt.sessionmaker() as loser:
        pub = new_pub()
        loser.add(
            SshKey(
                user_id=admin_id,
                key_type="ssh-ed25519",
                public_key=pub,
                fingerprint=sshca.fingerprint(pub),
            )
        )
        await loser.flush()
        real_get = loser.get
        calls = 0

        async def stale_get(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            # The first look happened before the winner committed.
            return None if calls == 1 else await real_get(*args, **kwargs)

        monkeypatch.setattr(loser, "get", stale_get)
        got = await org_authority(loser, org_id, "host")
        assert calls == 2
        assert (got.private_key, got.public_key) == (won.private_key, won.public_key)
        await loser.commit()
    async with rt.sessionmaker() as s:
        assert await s.scalar(select(func.count()).select_from(SshAuthority)) == 1
        assert (await s.scalars(select(SshKey.public_key))).all() == [pub]


# --- certificates ------------------------------------------------------------------------


async def test_certificate_for_the_login_node(
    api: ApiHarness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = await _ready_cluster(api)
    pair = sshca.new_keypair("ephemeral")
    caplog.set_level("INFO", logger="gpuclusters.server.services.ssh")
    r = await api.client.post(
        f"{P}/clusters/demo/ssh-certificate", json={"public_key": pair.public_openssh}
    )
    assert r.status_code == 200, r.text
    cert = r.json()
    ca = (await api.client.get("/v1/ssh-ca")).json()
    assert {k: cert[k] for k in ("cluster", "user", "principal", "host", "port")} == {
        "cluster": "demo",
        "user": "admin",
        "principal": "admin",
        "host": GATEWAY,
        "port": port,
    }
    assert cert["node_host"] is None
    assert cert["known_hosts"] == ca["known_hosts"]
    info = sshca.inspect_certificate(cert["certificate"])
    assert not info.is_host
    assert info.principals == ("admin",)
    assert info.key_id == "gpuclusters:default/admin:demo"
    assert info.signed_by == " ".join(ca["user_ca_public_key"].split()[:2])
    valid_before = datetime.fromisoformat(cert["valid_before"])
    assert valid_before == info.valid_before
    expected = datetime.now(UTC) + timedelta(hours=api.settings.ssh_cert_validity_h)
    assert abs((valid_before - expected).total_seconds()) < 60
    assert info.valid_after < datetime.now(UTC)
    # The certificate certifies the key that was sent.
    assert cert["certificate"].split()[0] == "ssh-ed25519-cert-v01@openssh.com"
    # Logged without keys or certificates.
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "issued ssh certificate: user=admin" in logged
    assert sshca.fingerprint(pair.public_openssh) in logged
    assert pair.public_openssh.split()[1] not in logged
    assert cert["certificate"].split()[1] not in logged

    if shutil.which("ssh-keygen"):
        path = tmp_path / "id-cert.pub"
        path.write_text(cert["certificate"] + "\n")
        shown = ssh_keygen("-L", "-f", str(path)).stdout
        assert "Type: ssh-ed25519-cert-v01@openssh.com user certificate" in shown
        assert 'Key ID: "gpuclusters:default/admin:demo"' in shown
        assert "Principals: \n                admin\n" in shown
        assert "permit-pty" in shown and "permit-X11-forwarding" not in shown


async def test_certificate_for_a_node_and_for_an_editor(api: ApiHarness) -> None:
    await _ready_cluster(api)
    async with api.runtime.sessionmaker() as s:
        node = (await s.scalars(select(Node).where(Node.deleted_at.is_(None)))).first()
        assert node is not None
        node_name = node.name
    async with api.as_key(await _user_key(api, "alice")) as alice:
        r = await alice.post(
            f"{P}/clusters/demo/ssh-certificate",
            json={"public_key": new_pub(), "node": node_name},
        )
        assert r.status_code == 200, r.text
        assert r.json()["node_host"] == node_name
        assert r.json()["principal"] == r.json()["user"] == "alice"
        info = sshca.inspect_certificate(r.json()["certificate"])
        assert info.principals == ("alice",)
        assert info.key_id == f"gpuclusters:default/alice:demo/{node_name}"
        r = await alice.post(
            f"{P}/clusters/demo/ssh-certificate", json={"public_key": new_pub(), "node": "nope"}
        )
        assert r.status_code == 404 and r.json()["field"] == "node"


async def test_certificate_refusals(api: ApiHarness) -> None:
    await _ready_cluster(api, port=None)
    url = f"{P}/clusters/demo/ssh-certificate"
    r = await api.client.post(url, json={"public_key": new_pub()})
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    assert "demo has no SSH endpoint yet" in r.json()["message"]
    async with api.runtime.sessionmaker() as s:
        cluster = (await s.scalars(select(Cluster))).one()
        cluster.ssh_port = SSH_PORT
        await s.commit()
    r = await api.client.post(url, json={"public_key": "ssh-rsa AAAA"})
    assert r.status_code == 422 and r.json()["field"] == "public_key"
    r = await api.client.post(url, json={})
    assert r.status_code == 422 and r.json()["field"] == "public_key"
    r = await api.client.post(f"{P}/clusters/nope/ssh-certificate", json={"public_key": new_pub()})
    assert r.status_code == 404 and r.json()["field"] == "name"
    # Somebody outside the project: not_found, like a project that does not exist.
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    async with api.as_key(await _user_key(api, "bob", project="other")) as bob:
        r = await bob.post(url, json={"public_key": new_pub()})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert r.json()["field"] == "project"
    # Not ready (yet, or any more): invalid_state.
    async with api.runtime.sessionmaker() as s:
        cluster = (await s.scalars(select(Cluster))).one()
        cluster.status = "waiting_for_nodes"
        await s.commit()
    r = await api.client.post(url, json={"public_key": new_pub()})
    assert r.status_code == 409 and "not ready" in r.json()["message"]


async def test_root_shell_is_for_organization_admins(api: ApiHarness) -> None:
    await _ready_cluster(api)
    url = f"{P}/clusters/demo/ssh"
    async with api.as_key(await _user_key(api, "alice")) as alice:
        r = await alice.post(url, json={"command": ["id"], "as_root": True})
        assert r.status_code == 403 and r.json()["code"] == "forbidden"
    # An admin passes the check; the fake provider has no shells at all.
    r = await api.client.post(url, json={"command": ["id"], "as_root": True})
    assert r.status_code == 409 and "no shell access" in r.json()["message"]
    r = await api.client.post(url, json={"command": ["id"], "as_root": "maybe"})
    assert r.status_code == 422 and r.json()["field"] == "as_root"
    assert (await api.client.post(url)).status_code == 409  # the body may be omitted


async def test_keys_per_user_are_limited(api: ApiHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpuclusters.server.services.ssh_keys.MAX_KEYS_PER_USER", 2)
    for _ in range(2):
        r = await api.client.post("/v1/ssh-keys", json={"public_key": new_pub()})
        assert r.status_code == 201
    r = await api.client.post("/v1/ssh-keys", json={"public_key": new_pub()})
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"
    assert "delete one first" in r.json()["message"]
