"""Single sign-on against a real Dex (services/sso.py, controllers/
sso_sessions.py, security/oidc.py): the device flow signs a user in with
the roles their groups give; a recheck takes a role away when the group
goes, and locks out a user the provider drops; the console's
authorization-code flow; tokens from another issuer or with a bad
signature are refused."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from sqlalchemy import select, update

from gpuclusters.server.controllers.sso_sessions import recheck_sessions
from gpuclusters.server.db.models import SsoSession, utcnow
from gpuclusters.server.security.oidc import OidcClient, OidcError
from support.api import ApiHarness
from support.dex import DEX_BIN, Dex, DexUser, sign_in_browser, sign_in_device
from support.processes import free_port

pytestmark = pytest.mark.skipif(
    not DEX_BIN.is_file(), reason="run scripts/build-k8s-addons dex first"
)
CALLBACK = "http://testserver/login/sso/callback"
RECHECK_S = 1.0
GROUPS = [
    {"group": "ml-team", "project": "default", "role": "editor"},
    {"group": "ml-leads", "project": "default", "role": "admin"},
    {"group": "platform", "org_admin": True},
]


@pytest.fixture(scope="module")
def dex(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dex]:
    d = Dex(
        tmp_path_factory.mktemp("dex"),
        host="127.0.0.1",
        port=free_port(),
        redirect_uris=[CALLBACK],
        users=list(_users().values()),
    )
    d.start()
    yield d
    d.stop()


def _users() -> dict[str, DexUser]:
    return {
        "alice": DexUser("alice", ["ml-team"], user_id="00000000-0000-4000-8000-00000000a11c"),
        "olga": DexUser("olga", ["platform"], user_id="00000000-0000-4000-8000-0000000001a0"),
    }


@pytest.fixture
def settings_overrides(dex: Dex) -> dict[str, Any]:
    dex.users = _users()  # each test starts from these
    dex.restart()
    return {
        "sso_issuer": dex.issuer,
        "sso_client_secret": dex.client_secret,
        "sso_group_roles": GROUPS,
        "sso_recheck_interval_s": RECHECK_S,
    }


async def _device_sign_in(api: ApiHarness, user: str) -> dict[str, Any]:
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as cli:
        assert (await cli.get("/v1/auth/sso")).json()["enabled"] is True
        started = await cli.post("/v1/auth/sso/device")
        assert started.status_code == 200, started.text
        start = started.json()
        body = {"device_code": start["device_code"]}
        pending = await cli.post("/v1/auth/sso/device/token", json=body)
        assert pending.status_code == 202 and pending.json()["status"] == "pending"
        page = await asyncio.to_thread(
            sign_in_device,
            start["verification_uri"],
            start["user_code"],
            email=f"{user}@example.com",
        )
        assert "Login Successful" in page or "login successful" in page.lower(), page[:500]
        done = await cli.post("/v1/auth/sso/device/token", json=body)
        assert done.status_code == 200, done.text
        return dict(done.json())


async def _whoami(api: ApiHarness, key: str) -> httpx.Response:
    async with api.as_key(key) as c:
        return await c.get("/v1/whoami")


async def _until(what: str, check: Any, within_s: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.2)


async def test_device_sign_in_gives_the_groups_roles(api: ApiHarness, dex: Dex) -> None:
    signed = await _device_sign_in(api, "alice")
    assert signed["user"] == "alice" and signed["projects"] == {"default": "editor"}
    assert signed["key"].startswith("gpc_") and not signed["is_admin"]
    me = (await _whoami(api, signed["key"])).json()
    assert me["user"] == "alice" and me["projects"] == {"default": "editor"}
    # The user was made at the first sign-in, with a Unix uid, linked to
    # the provider's subject: a second sign-in is the same user.
    users = {u["name"]: u for u in (await api.client.get("/v1/users")).json()}
    assert users["alice"]["uid"] >= 10000
    again = await _device_sign_in(api, "alice")
    assert again["user"] == "alice" and again["key"] != signed["key"]
    olga = await _device_sign_in(api, "olga")
    assert olga["is_admin"] is True
    # Signing out ends that session only.
    async with api.as_key(signed["key"]) as c:
        assert (await c.post("/v1/auth/logout")).status_code == 204
    assert (await _whoami(api, signed["key"])).status_code == 401
    assert (await _whoami(api, again["key"])).status_code == 200
    # The audit log has the sign-ins, by the user they signed in.
    log = (await api.client.get("/v1/audit", params={"user": "alice"})).json()
    assert [e["action"] for e in log].count("poll_device") == 2
    assert log[0]["action"] == "logout"


async def test_a_second_sign_in_supersedes_the_first_without_a_lockout(
    api: ApiHarness, dex: Dex
) -> None:
    """Dex keeps one refresh token per user and client: a second sign-in
    (the console, after the CLI) makes the first session's token stale.
    Its recheck then ends that session only; the user, vouched for by the
    newer session, keeps working. (Seen in CI: a recheck between two
    sign-ins locked the user out.)"""
    first = await _device_sign_in(api, "alice")
    second = await _device_sign_in(api, "alice")
    async with api.runtime.sessionmaker() as s:
        await s.execute(update(SsoSession).values(checked_at=utcnow() - timedelta(hours=1)))
        await s.commit()
    await recheck_sessions(api.runtime)
    assert (await _whoami(api, first["key"])).status_code == 401
    me = await _whoami(api, second["key"])
    assert me.status_code == 200 and me.json()["projects"] == {"default": "editor"}
    async with api.runtime.sessionmaker() as s:
        ended = list(await s.scalars(select(SsoSession).where(SsoSession.ended_at.is_not(None))))
    assert len(ended) == 1 and "refused" in ended[0].end_reason


async def test_leaving_a_group_takes_the_role_and_a_dropped_user_is_locked_out(
    api: ApiHarness, dex: Dex
) -> None:
    signed = await _device_sign_in(api, "alice")
    key = signed["key"]
    # Promoted at the provider: admin at the next recheck.
    dex.users["alice"].groups = ["ml-team", "ml-leads"]
    await asyncio.to_thread(dex.restart)

    async def role_is(role: str | None) -> bool:
        me = (await _whoami(api, key)).json()
        return me.get("projects", {}).get("default") == role

    await _until("alice is default's admin", lambda: role_is("admin"))
    # Out of every group: no role, so the project is gone from her view.
    dex.users["alice"].groups = []
    await asyncio.to_thread(dex.restart)
    await _until("alice has no role", lambda: role_is(None))
    async with api.as_key(key) as c:
        assert (await c.get("/v1/projects/default/clusters")).status_code == 404
    # Removed at the provider: the refresh fails, she is locked out.
    del dex.users["alice"]
    await asyncio.to_thread(dex.restart)

    async def locked_out() -> bool:
        return (await _whoami(api, key)).status_code == 401

    await _until("alice locked out", locked_out)
    # Sign-ins are refused too.
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as cli:
        start = (await cli.post("/v1/auth/sso/device")).json()
        with pytest.raises(PermissionError):
            await asyncio.to_thread(
                sign_in_device, start["verification_uri"], start["user_code"],
                email="alice@example.com",
            )  # fmt: skip


async def test_console_signs_in_with_the_authorization_code_flow(api: ApiHarness, dex: Dex) -> None:
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as browser:
        login = await browser.get("/login")
        assert 'id="sso-sign-in"' in login.text
        go = await browser.get("/login/sso")
        assert go.status_code == 303
        authorize = go.headers["location"]
        query = parse_qs(urlsplit(authorize).query)
        assert query["code_challenge_method"] == ["S256"] and query["nonce"]
        # At the provider (a real HTTP client: Dex is another process).
        back = await asyncio.to_thread(sign_in_browser, authorize, email="alice@example.com")
        assert back.startswith(CALLBACK), back
        done = await browser.get(back.removeprefix("http://testserver"))
        assert done.status_code == 303 and done.headers["location"] == "/"
        home = await browser.get("/")
        assert home.status_code == 200 and "alice" in home.text
        # The same state cannot be used twice.
        replay = await browser.get(back.removeprefix("http://testserver"))
        assert replay.status_code == 401
    log = (await api.client.get("/v1/audit", params={"user": "alice"})).json()
    assert not log or all(e["via"] in ("api", "console") for e in log)


async def test_tokens_of_another_issuer_or_with_a_bad_signature_are_refused(
    api: ApiHarness, dex: Dex, tmp_path: Path
) -> None:
    other = Dex(
        tmp_path / "other",
        host="127.0.0.1",
        port=free_port(),
        redirect_uris=[CALLBACK],
        users=[DexUser("alice", ["ml-team"])],
        client_secret=dex.client_secret,
    )
    await asyncio.to_thread(other.start)
    try:
        theirs = OidcClient(
            issuer=other.issuer,
            client_id="gpuclusters",
            client_secret=other.client_secret,
            scopes=["openid", "email", "groups", "offline_access"],
        )
        start = await theirs.start_device()
        await asyncio.to_thread(
            sign_in_device, start.verification_uri, start.user_code, email="alice@example.com"
        )
        got = await theirs.poll_device(start.device_code)
        assert not hasattr(got, "slow_down")
        token = got.id_token  # type: ignore[union-attr]
        await theirs.close()
    finally:
        other.stop()
    ours = api.runtime.oidc
    assert ours is not None
    with pytest.raises(OidcError):
        await ours.verify_id_token(token)  # another issuer's
    # Our own provider's token, with its payload changed: the signature fails.
    start = await ours.start_device()
    await asyncio.to_thread(
        sign_in_device, start.verification_uri, start.user_code, email="alice@example.com"
    )
    mine = await ours.poll_device(start.device_code)
    good = mine.id_token  # type: ignore[union-attr]
    assert (await ours.verify_id_token(good))["email"] == "alice@example.com"
    head, payload, signature = good.split(".")
    claims = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    forged = claims.replace(b'"alice@example.com"', b'"olga@example.com"')
    assert forged != claims
    forged_token = ".".join(
        [head, base64.urlsafe_b64encode(forged).rstrip(b"=").decode(), signature]
    )
    with pytest.raises(OidcError, match="not valid"):
        await ours.verify_id_token(forged_token)


async def test_a_provider_that_does_not_answer_ends_no_session(api: ApiHarness, dex: Dex) -> None:
    signed = await _device_sign_in(api, "alice")
    await asyncio.to_thread(dex.stop)
    try:
        # Several recheck intervals with the provider down: still signed in.
        await asyncio.sleep(4 * RECHECK_S + 2 * api.settings.housekeeping_interval_s)
        assert (await _whoami(api, signed["key"])).status_code == 200
    finally:
        await asyncio.to_thread(dex.start)
    # Back up: the next recheck goes through (a role change still applies).
    dex.users["alice"].groups = ["ml-leads"]
    await asyncio.to_thread(dex.restart)

    async def admin_again() -> bool:
        me = (await _whoami(api, signed["key"])).json()
        return me.get("projects", {}).get("default") == "admin"

    await _until("alice rechecked once the provider is back", admin_again)
