"""``gpuclusters projects members ...`` and ``gpuclusters users ...`` against
canned HTTP answers (the same harness as tests/test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuclusters.core.models import ProjectMember, User
from support.cli import install_fake_api, isolate_env, ok, run
from support.fake_api import FakeApi

T0 = "2025-01-01T00:00:00Z"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_env(monkeypatch, tmp_path)


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    return install_fake_api(monkeypatch)


def member_json(user: str, role: str = "editor", uid: int | None = 10001) -> dict[str, Any]:
    return {"user": user, "role": role, "uid": uid}


def user_json(name: str, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "uid": 10001,
        "is_admin": False,
        "created_at": T0,
        "projects": {"default": "editor", "research": "admin"},
        "deleted_at": None,
    }
    body.update(changes)
    return body


# --- projects members ------------------------------------------------------------------------


def test_members_list_table_and_json(api: FakeApi) -> None:
    members = [member_json("admin", "admin", 10000), member_json("alice")]
    api.on("GET", "/v1/projects/default/members", ok(members))

    table = run("projects", "members", "list")
    as_json = run("projects", "members", "list", "-o", "json")

    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["USER", "ROLE", "UID"]
    assert lines[1].split() == ["admin", "admin", "10000"]
    assert lines[2].split() == ["alice", "editor", "10001"]
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == [
        ProjectMember.model_validate(m).model_dump(mode="json") for m in members
    ]


def test_members_list_takes_the_project_flag(api: FakeApi) -> None:
    api.on("GET", "/v1/projects/research/members", ok([]))
    result = run("projects", "members", "list", "--project", "research")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and "no members" in result.stderr
    assert [r.url.path for r in api.requests] == ["/v1/projects/research/members"]


def test_members_remove(api: FakeApi) -> None:
    api.on("DELETE", "/v1/projects/research/members/alice", ok(member_json("alice")))

    table = run("projects", "members", "remove", "alice", "-p", "research")
    as_json = run("projects", "members", "remove", "alice", "-p", "research", "-o", "json")

    assert table.exit_code == 0, table.output
    assert "removed alice (editor) from project research" in table.stdout
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == member_json("alice")
    assert [(r.method, r.url.path) for r in api.requests] == [
        ("DELETE", "/v1/projects/research/members/alice"),
    ] * 2


def test_members_remove_of_the_last_admin_is_refused_clearly(api: FakeApi) -> None:
    refusal = {
        "code": "invalid_state",
        "message": "'bob' is the last admin of project 'default'; give another member "
        "the admin role first (api-keys create --role admin)",
        "field": "user",
    }
    api.on("DELETE", "/v1/projects/default/members/bob", ok(refusal, 409))
    result = run("projects", "members", "remove", "bob", "-o", "json")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error [invalid_state]: 'bob' is the last admin")
    assert "(field: user)" in result.stderr


# --- users -----------------------------------------------------------------------------------


def test_users_list_table_and_json(api: FakeApi) -> None:
    users = [
        user_json("admin", uid=10000, is_admin=True, projects={"default": "admin"}),
        user_json("alice"),
    ]
    api.on("GET", "/v1/users", ok(users))

    table = run("users", "list")
    as_json = run("users", "list", "--output", "json")

    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NAME", "UID", "ORG_ADMIN", "PROJECTS", "AGE"]
    assert lines[1].split()[:4] == ["admin", "10000", "yes", "default"]
    assert "default (editor), research (admin)" in lines[2]
    assert json.loads(as_json.stdout) == [
        User.model_validate(u).model_dump(mode="json") for u in users
    ]
    assert "include_deleted" not in str(api.requests[0].url)


def test_users_list_include_deleted(api: FakeApi) -> None:
    users = [user_json("admin", is_admin=True), user_json("carol", projects={}, deleted_at=T0)]
    api.on("GET", "/v1/users", ok(users))
    result = run("users", "list", "--include-deleted")
    assert result.exit_code == 0, result.output
    assert "DELETED" in result.stdout.splitlines()[0]
    assert api.requests[0].url.params["include_deleted"] == "true"


def test_users_delete(api: FakeApi) -> None:
    deleted = user_json("carol", projects={}, deleted_at=T0)
    api.on("DELETE", "/v1/users/carol", ok(deleted))

    table = run("users", "delete", "carol")
    as_json = run("users", "delete", "carol", "-o", "json")

    assert table.exit_code == 0, table.output
    assert "deleted user carol" in table.stdout and "uid 10001" in table.stdout
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == User.model_validate(deleted).model_dump(mode="json")
    assert [r.method for r in api.requests] == ["DELETE", "DELETE"]


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        (409, "invalid_state", "you cannot delete yourself; ask another organization admin"),
        (403, "forbidden", "deleting users is for organization admins"),
        (404, "not_found", "user 'nobody' not found"),
    ],
)
def test_users_delete_errors(api: FakeApi, status: int, code: str, message: str) -> None:
    api.on(
        "DELETE",
        "/v1/users/nobody",
        ok({"code": code, "message": message, "field": "name"}, status),
    )
    result = run("users", "delete", "nobody")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip() == f"error [{code}]: {message} (field: name)"
