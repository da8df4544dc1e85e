"""Who may pull and push which registry repositories (core.registry_access)
and the tokens that say so (server.security.registry_tokens): scopes are
parsed as the Docker token specification writes them, grants are the
intersection of what was asked and what is allowed, and the signed token
verifies with the published key set under the registry's expectations."""

from __future__ import annotations

import json
from pathlib import Path

import jwt
import pytest

from gpuclusters.core.registry_access import (
    Grant,
    RegistryCaller,
    allowed_actions,
    grants,
    parse_scopes,
    project_of,
)
from gpuclusters.server.security.registry_tokens import (
    ISSUER,
    SERVICE,
    ensure_registry_keys,
)

MEMBER = RegistryCaller(
    subject="alice", pull_projects=frozenset({"ml"}), push_projects=frozenset({"ml"})
)
CLUSTER = RegistryCaller(subject="cluster-1", pull_projects=frozenset({"ml"}))
ANONYMOUS = RegistryCaller(subject="anonymous")


def test_parse_scopes_splits_repeated_and_space_separated_values() -> None:
    scopes = parse_scopes(
        ["repository:ml/train:pull,push repository:kueue:pull", "registry:catalog:*", "junk"]
    )
    assert [(s.resource_type, s.name, s.actions) for s in scopes] == [
        ("repository", "ml/train", ("pull", "push")),
        ("repository", "kueue", ("pull",)),
        ("registry", "catalog", ("*",)),
    ]


@pytest.mark.parametrize(
    ("caller", "repository", "expected"),
    [
        (MEMBER, "ml/train", {"pull", "push"}),
        (MEMBER, "ml/a/b/c", {"pull", "push"}),
        (MEMBER, "other/train", set()),  # another project: nothing
        (CLUSTER, "ml/train", {"pull"}),  # nodes only pull
        (CLUSTER, "other/train", set()),
        (MEMBER, "kueue", {"pull"}),  # system images: pull only
        (CLUSTER, "gpuclusters-base", {"pull"}),
        (ANONYMOUS, "kueue", {"pull"}),
        (ANONYMOUS, "ml/train", set()),
        (MEMBER, "ML/Train", set()),  # not a repository name
        (MEMBER, "ml//x", set()),
    ],
)
def test_allowed_actions(caller: RegistryCaller, repository: str, expected: set[str]) -> None:
    assert allowed_actions(caller, repository) == expected


def test_grants_are_what_was_asked_and_allowed() -> None:
    asked = parse_scopes(
        [
            "repository:ml/train:pull,push",
            "repository:other/x:pull",
            "repository:kueue:push,pull",
            "repository:ml/all:*",
            "registry:catalog:*",
        ]
    )
    assert grants(MEMBER, asked) == [
        Grant("ml/train", ("pull", "push")),
        Grant("kueue", ("pull",)),
        Grant("ml/all", ("pull", "push")),
    ]
    assert grants(CLUSTER, asked) == [
        Grant("ml/train", ("pull",)),
        Grant("kueue", ("pull",)),
        Grant("ml/all", ("pull",)),
    ]


def test_project_of() -> None:
    assert project_of("ml/train") == "ml"
    assert project_of("torch") is None


def test_tokens_verify_with_the_published_key_set(tmp_path: Path) -> None:
    keys = ensure_registry_keys(tmp_path)
    access = [Grant("ml/train", ("pull",)).claim()]
    token, now = keys.mint(subject="alice", access=access)
    jwks = json.loads(keys.jwks_file.read_text())
    (jwk,) = jwks["keys"]
    assert jwk["kid"] == keys.kid == jwt.get_unverified_header(token)["kid"]
    public = jwt.PyJWK(jwk).key
    claims = jwt.decode(token, public, algorithms=["ES256"], audience=SERVICE, issuer=ISSUER)
    assert claims["sub"] == "alice"
    assert claims["access"] == [{"type": "repository", "name": "ml/train", "actions": ["pull"]}]
    assert claims["nbf"] <= now < claims["exp"]
    # The key is made once: a second load keeps it (and the key set).
    again = ensure_registry_keys(tmp_path)
    assert again.kid == keys.kid
    assert (tmp_path / "registry" / "token-key.pem").stat().st_mode & 0o777 == 0o600


def test_cluster_pull_credentials(tmp_path: Path) -> None:
    keys = ensure_registry_keys(tmp_path)
    user, password = keys.cluster_credential("c1")
    assert user == "cluster-c1"
    assert keys.cluster_of(user, password) == "c1"
    wrong = password[:-1] + ("1" if password[-1] != "1" else "2")
    assert keys.cluster_of(user, wrong) is None
    assert keys.cluster_of("cluster-c2", password) is None
    assert keys.cluster_of("alice", password) is None
    # Another server's key makes other credentials.
    other = ensure_registry_keys(tmp_path / "other")
    assert other.cluster_credential("c1") != (user, password)
