"""Project members and users: listing, removing, deleting, and what that
revokes (API keys at once; cluster accounts through ``cluster_users``)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from gpuclusters.core.errors import InvalidStateError
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.refs import cluster_users
from gpuclusters.server.db.models import ApiKey, Cluster, Project, ProjectMember, SshKey, User
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy
from support.api import ApiHarness


async def _key(api: ApiHarness, *, user: str, project: str, role: str = "editor") -> str:
    r = await api.client.post("/v1/api-keys", json={"user": user, "project": project, "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def _project(api: ApiHarness, name: str) -> None:
    r = await api.client.post("/v1/projects", json={"name": name})
    assert r.status_code == 201, r.text


async def _make_org_admin(api: ApiHarness, name: str) -> None:
    """There is no API for this (only the bootstrap makes org admins)."""
    async with api.runtime.sessionmaker() as session:
        await session.execute(update(User).where(User.name == name).values(is_admin=True))
        await session.commit()


async def _user_row(api: ApiHarness, name: str) -> User:
    async with api.runtime.sessionmaker() as session:
        return await session.scalar(select(User).where(User.name == name)) or pytest.fail(name)


def _error(r: Any, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    return str(body["message"])


async def test_members_list_and_removing_a_member_hides_the_project(api: ApiHarness) -> None:
    await _project(api, "p2")
    alice = await _key(api, user="alice", project="p2")
    async with api.as_key(alice) as c:
        assert (await c.get("/v1/projects/p2/clusters")).status_code == 200
        # Members may see who else is a member.
        r = await c.get("/v1/projects/p2/members")
    assert r.status_code == 200, r.text
    uid = (await _user_row(api, "alice")).uid
    assert r.json() == [
        {"user": "admin", "role": "admin", "uid": tenancy.FIRST_UID},
        {"user": "alice", "role": "editor", "uid": uid},
    ]

    before = api.runtime.hints.count(hints.ACCESS)
    r = await api.client.delete("/v1/projects/p2/members/alice")
    assert r.status_code == 200, r.text
    assert r.json() == {"user": "alice", "role": "editor", "uid": uid}
    assert api.runtime.hints.count(hints.ACCESS) == before + 1

    async with api.as_key(alice) as c:
        for path in ("/v1/projects/p2/clusters", "/v1/projects/p2/members"):
            _error(await c.get(path), 404, "not_found")
        assert (await c.get("/v1/projects")).json() == []
    members = (await api.client.get("/v1/projects/p2/members")).json()
    assert [m["user"] for m in members] == ["admin"]
    # Not a member (any more), and no such user: both 404.
    msg = _error(await api.client.delete("/v1/projects/p2/members/alice"), 404, "not_found")
    assert "not a member" in msg
    _error(await api.client.delete("/v1/projects/p2/members/nobody"), 404, "not_found")
    _error(await api.client.get("/v1/projects/nope/members"), 404, "not_found")


async def test_the_last_admin_of_a_project_stays(api: ApiHarness) -> None:
    msg = _error(
        await api.client.delete("/v1/projects/default/members/admin"), 409, "invalid_state"
    )
    assert "last admin" in msg and "default" in msg

    bob = await _key(api, user="bob", project="default", role="admin")
    # A second admin: the first may go (an org admin still administers it).
    assert (await api.client.delete("/v1/projects/default/members/admin")).status_code == 200
    async with api.as_key(bob) as c:
        # A project admin (not org admin) may remove members, but not the last admin.
        _error(await c.delete("/v1/projects/default/members/bob"), 409, "invalid_state")
        eve = await _key(api, user="eve", project="default")
        assert (await c.delete("/v1/projects/default/members/eve")).status_code == 200
    async with api.as_key(eve) as c:
        _error(await c.get("/v1/projects/default/clusters"), 404, "not_found")


async def test_non_admins_are_refused(api: ApiHarness) -> None:
    await _project(api, "p2")
    eve = await _key(api, user="eve", project="default")
    mallory = await _key(api, user="mallory", project="p2", role="admin")
    async with api.as_key(eve) as c:
        assert (await c.get("/v1/projects/default/members")).status_code == 200
        _error(await c.delete("/v1/projects/default/members/admin"), 403, "forbidden")
        _error(await c.delete("/v1/projects/default/members/eve"), 403, "forbidden")
        _error(await c.get("/v1/users"), 403, "forbidden")
        _error(await c.delete("/v1/users/mallory"), 403, "forbidden")
    async with api.as_key(mallory) as c:
        # Admin of another project: the default project does not exist for them.
        _error(await c.get("/v1/projects/default/members"), 404, "not_found")
        _error(await c.delete("/v1/projects/default/members/eve"), 404, "not_found")
        # A project admin is not an org admin.
        _error(await c.get("/v1/users"), 403, "forbidden")
        _error(await c.delete("/v1/users/eve"), 403, "forbidden")
    assert [m["user"] for m in (await api.client.get("/v1/projects/default/members")).json()] == [
        "admin",
        "eve",
    ]


async def test_list_users(api: ApiHarness) -> None:
    await _project(api, "p2")
    await _key(api, user="carol", project="default")
    await _key(api, user="carol", project="p2", role="admin")
    r = await api.client.get("/v1/users")
    assert r.status_code == 200, r.text
    users = {u["name"]: u for u in r.json()}
    assert list(users) == ["admin", "carol"]
    assert users["admin"]["is_admin"] is True
    assert users["admin"]["uid"] == tenancy.FIRST_UID
    assert users["admin"]["projects"] == {"default": "admin", "p2": "admin"}
    assert users["carol"]["is_admin"] is False
    assert users["carol"]["uid"] == tenancy.FIRST_UID + 1
    assert users["carol"]["projects"] == {"default": "editor", "p2": "admin"}
    assert users["carol"]["deleted_at"] is None and users["carol"]["created_at"]


async def test_deleting_a_user_revokes_everything_and_keeps_name_and_uid(
    api: ApiHarness,
) -> None:
    await _project(api, "p2")
    carol = await _key(api, user="carol", project="default")
    carol2 = await _key(api, user="carol", project="p2", role="admin")
    row = await _user_row(api, "carol")
    async with api.runtime.sessionmaker() as session:
        session.add(
            SshKey(
                user_id=row.id,
                name="laptop",
                key_type="ssh-ed25519",
                public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPlaceholder",
                fingerprint="SHA256:placeholder",
            )
        )
        await session.commit()

    before = api.runtime.hints.count(hints.ACCESS)
    r = await api.client.delete("/v1/users/carol")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "carol" and body["uid"] == row.uid
    assert body["projects"] == {} and body["deleted_at"]
    assert api.runtime.hints.count(hints.ACCESS) == before + 1

    for key in (carol, carol2):
        async with api.as_key(key) as c:
            _error(await c.get("/v1/whoami"), 401, "unauthenticated")
    async with api.runtime.sessionmaker() as session:
        keys = (await session.scalars(select(ApiKey).where(ApiKey.user_id == row.id))).all()
        assert len(keys) == 2 and all(k.revoked_at is not None for k in keys)
        ssh = (await session.scalars(select(SshKey).where(SshKey.user_id == row.id))).all()
        assert len(ssh) == 1 and ssh[0].deleted_at is not None
        assert (
            await session.scalars(select(ProjectMember).where(ProjectMember.user_id == row.id))
        ).all() == []

    # Gone from listings, unless asked for.
    assert [u["name"] for u in (await api.client.get("/v1/users")).json()] == ["admin"]
    listed = (await api.client.get("/v1/users", params={"include_deleted": "true"})).json()
    assert [(u["name"], u["deleted_at"] is not None) for u in listed] == [
        ("admin", False),
        ("carol", True),
    ]
    for project in ("default", "p2"):
        members = (await api.client.get(f"/v1/projects/{project}/members")).json()
        assert "carol" not in [m["user"] for m in members]

    # The name is not handed out again; the uid neither.
    r = await api.client.post(
        "/v1/api-keys", json={"user": "carol", "project": "default", "role": "editor"}
    )
    msg = _error(r, 409, "invalid_state")
    assert "deleted" in msg and "another name" in msg
    await _key(api, user="dave", project="default")
    assert (await _user_row(api, "dave")).uid == (row.uid or 0) + 1
    _error(await api.client.delete("/v1/users/carol"), 404, "not_found")
    _error(await api.client.delete("/v1/users/nobody"), 404, "not_found")


async def test_a_deleted_users_key_is_refused_even_if_not_revoked(api: ApiHarness) -> None:
    carol = await _key(api, user="carol", project="default")
    assert (await api.client.delete("/v1/users/carol")).status_code == 200
    async with api.runtime.sessionmaker() as session:
        await session.execute(update(ApiKey).values(revoked_at=None))
        await session.commit()
    async with api.as_key(carol) as c:
        _error(await c.get("/v1/projects/default/clusters"), 401, "unauthenticated")
    # The un-revoke touched every key; the admin's works as before.
    assert (await api.client.get("/v1/whoami")).status_code == 200


async def test_no_self_delete_and_the_last_org_admin_stays(api: ApiHarness) -> None:
    msg = _error(await api.client.delete("/v1/users/admin"), 409, "invalid_state")
    assert "yourself" in msg

    bob = await _key(api, user="bob", project="default")
    await _make_org_admin(api, "bob")
    admin = await _user_row(api, "admin")
    async with api.as_key(bob) as c:
        r = await c.delete("/v1/users/admin")
        assert r.status_code == 200, r.text
        assert r.json()["is_admin"] is True
        _error(await c.delete("/v1/users/bob"), 409, "invalid_state")
    _error(await api.client.get("/v1/whoami"), 401, "unauthenticated")

    # The deleted admin's request that was already past authentication (two
    # admins deleting each other at once) cannot remove the last admin.
    stale = Principal(
        user_id=admin.id,
        user_name="admin",
        organization_id=admin.organization_id,
        is_admin=True,
    )
    async with api.runtime.sessionmaker() as session:
        with pytest.raises(InvalidStateError, match="last admin"):
            await tenancy.delete_user(session, principal=stale, name="bob")
    assert (await _user_row(api, "bob")).deleted_at is None


async def test_cluster_users_exclude_deleted_users_and_removed_members(api: ApiHarness) -> None:
    await _key(api, user="alice", project="default")
    await _key(api, user="bob", project="default", role="admin")
    await _key(api, user="carol", project="default")
    await _project(api, "p2")
    await _key(api, user="dave", project="p2")  # another project's member
    await _key(api, user="erin", project="p2")
    await _make_org_admin(api, "erin")  # org admins are on every cluster

    async def users() -> dict[str, bool]:
        async with api.runtime.sessionmaker() as session:
            project = await session.scalar(select(Project).where(Project.name == "default"))
            assert project is not None
            # Only the cluster's project matters to cluster_users.
            cluster = Cluster(project_id=project.id, name="demo")
            return {u.name: u.admin for u in await cluster_users(session, cluster)}

    assert await users() == {
        "admin": True,
        "alice": False,
        "bob": True,
        "carol": False,
        "erin": True,
    }
    assert (await api.client.delete("/v1/projects/default/members/alice")).status_code == 200
    assert (await api.client.delete("/v1/users/carol")).status_code == 200
    assert (await api.client.delete("/v1/users/erin")).status_code == 200
    assert await users() == {"admin": True, "bob": True}
