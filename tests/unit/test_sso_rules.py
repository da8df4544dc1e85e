"""core/sso.py: roles from groups and user names from claims; the cluster
tokens' signing and the apiserver's view of them (security/cluster_tokens,
layers/kubernetes/config.authentication_config); exec kubeconfigs."""

from __future__ import annotations

import json
from pathlib import Path

import jwt
import pytest
import yaml

from gpuclusters.core import kubeconfig
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.sso import GroupGrant, grants_for, groups_of, name_from_claims, numbered
from gpuclusters.layers.base import TokenIssuerRef
from gpuclusters.layers.kubernetes.config import K8sSpec, apiserver_argv, authentication_config
from gpuclusters.server.security.cluster_tokens import (
    TokenIssuer,
    audience_of,
    ensure_signing_key,
)

MAPPING = [
    GroupGrant("ml", project="default", role=ProjectRole.EDITOR),
    GroupGrant("ml-leads", project="default", role=ProjectRole.ADMIN),
    GroupGrant("vision", project="cv", role=ProjectRole.EDITOR),
    GroupGrant("ops", org_admin=True),
]


def test_groups_give_the_strongest_role_per_project() -> None:
    got = grants_for(["ml", "ml-leads", "vision", "unrelated"], MAPPING)
    assert got.projects == {"default": ProjectRole.ADMIN, "cv": ProjectRole.EDITOR}
    assert not got.org_admin
    assert grants_for(["ml-leads", "ml"], MAPPING).projects == {"default": ProjectRole.ADMIN}
    assert grants_for(["ops"], MAPPING).org_admin
    assert grants_for([], MAPPING).projects == {}


def test_a_grant_is_either_org_admin_or_a_project_role() -> None:
    with pytest.raises(ValueError, match="either org_admin"):
        GroupGrant("x", project="p", role=ProjectRole.EDITOR, org_admin=True)
    with pytest.raises(ValueError, match="either org_admin"):
        GroupGrant("x")
    with pytest.raises(ValueError, match="needs a role"):
        GroupGrant("x", project="p")


def test_groups_claim_shapes() -> None:
    assert groups_of({"groups": ["a", 1, "b"]}, "groups") == ["a", "b"]
    assert groups_of({"groups": "a"}, "groups") == ["a"]
    assert groups_of({}, "groups") == []


def test_user_names_from_claims() -> None:
    assert name_from_claims({"preferred_username": "Ana.Lima"}, "preferred_username") == "ana-lima"
    assert name_from_claims({"email": "9bob@corp.example"}, "preferred_username") == "bob"
    assert name_from_claims({"upn": "x_Y"}, "upn") == "x-y"
    assert name_from_claims({"preferred_username": "1234"}, "preferred_username") == ""
    long = name_from_claims({"preferred_username": "a" * 60}, "preferred_username")
    assert len(long) == 40
    assert numbered("a" * 40, 12) == "a" * 37 + "-12"


def test_cluster_tokens_verify_with_the_published_key(tmp_path: Path) -> None:
    key = ensure_signing_key(tmp_path)
    assert ensure_signing_key(tmp_path) == key  # made once
    assert (tmp_path / "cluster-tokens" / "signing-key.pem").stat().st_mode & 0o777 == 0o600
    issuer = TokenIssuer(key, "https://gw.example:8443")
    minted = issuer.mint(user="bob", cluster_id="c1")
    public = jwt.PyJWK(issuer.jwks()["keys"][0])
    claims = jwt.decode(
        minted.token, public.key, algorithms=["ES256"], audience=audience_of("c1"),
        issuer="https://gw.example:8443",
    )  # fmt: skip
    assert claims["sub"] == "bob" and claims["groups"] == ["gpuclusters:users"]
    assert claims["exp"] - claims["iat"] == 300
    assert jwt.get_unverified_header(minted.token)["kid"] == issuer.kid
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(minted.token, public.key, algorithms=["ES256"], audience=audience_of("c2"))
    doc = issuer.discovery("https://10.0.0.1:8472/")
    assert doc["issuer"] == "https://gw.example:8443"
    assert doc["jwks_uri"] == "https://10.0.0.1:8472/v1/oidc/jwks"


def test_the_apiserver_trusts_the_server_for_its_own_audience() -> None:
    ref = TokenIssuerRef(
        issuer="https://gw:8443",
        audience="gpuclusters:c1",
        discovery_url="https://10.0.0.1:8472/.well-known/openid-configuration",
        ca_pem="-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
    )
    spec = K8sSpec(cluster_name="k", api_address="10.231.1.2", api_hostname="k-cp",
                   token_issuer=ref)  # fmt: skip
    doc = json.loads(authentication_config(spec))
    (entry,) = doc["jwt"]
    assert doc["apiVersion"] == "apiserver.config.k8s.io/v1"
    assert entry["issuer"]["url"] == "https://gw:8443"
    assert entry["issuer"]["audiences"] == ["gpuclusters:c1"]
    assert entry["issuer"]["discoveryURL"].endswith("/.well-known/openid-configuration")
    assert entry["claimMappings"]["username"] == {"claim": "sub", "prefix": ""}
    assert "--authentication-config=/etc/kubernetes/authentication.yaml" in apiserver_argv(spec)
    plain = K8sSpec(cluster_name="k", api_address="10.231.1.2", api_hostname="k-cp")
    assert not [a for a in apiserver_argv(plain) if "authentication-config" in a]


def test_exec_kubeconfigs_run_the_cli_that_wrote_them() -> None:
    config = kubeconfig.render(
        cluster_name="demo",
        server="https://gw:6443",
        ca_pem=b"ca",
        user_name="bob",
        exec_credential=kubeconfig.exec_user(project="ml", cluster="demo", user="bob"),
    )
    done = kubeconfig.with_exec_command(config, "/opt/bin/gpuclusters", {"GPUCLUSTERS_HOME": "/h"})
    exe = done["users"][0]["user"]["exec"]
    assert exe["command"] == "/opt/bin/gpuclusters"
    assert exe["args"] == ["clusters", "token", "demo", "--project", "ml", "--user", "bob"]
    assert exe["env"] == [{"name": "GPUCLUSTERS_HOME", "value": "/h"}]
    assert exe["apiVersion"] == "client.authentication.k8s.io/v1"
    assert yaml.safe_load(kubeconfig.dump(done)) == done
    with pytest.raises(ValueError, match="client certificate or an exec"):
        kubeconfig.render(cluster_name="d", server="https://x", ca_pem=b"", user_name="u")
