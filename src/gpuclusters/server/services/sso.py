"""Single sign-on: users signed in by the organization's identity provider,
their roles from its groups, and sessions the provider keeps deciding
(docs/identity.md).

**Sign-in** (the CLI's device flow, the console's authorization-code
flow; ``security/oidc.py`` checks the ID token): the user is the one linked
to the token's subject, made at the first sign-in (a name from its claims,
a Unix uid as for any user). Their roles are set from the token's groups
(``core/sso.py``), and a **session** is opened: an API key of its own that
ends with the session, and the provider's refresh token, kept here.

**Recheck**: housekeeping refreshes every open session at the provider
every ``sso_recheck_interval_s`` (at most 240 s). The provider re-reads the
user, so the new ID token's groups are applied again: a user removed from a
group loses that role within the interval, and access follows (the access
sync takes their account off the project's clusters and their Kubernetes
bindings away). A refresh the provider refuses (the user disabled or
removed, the grant revoked) **locks the user out**: every session of theirs
ends, every API key of theirs is revoked (console sessions with them) and
their roles are taken away, so SSH certificates are no longer signed and
nothing they hold works. A provider that cannot be reached ends nothing: the
session is tried again at the next pass (docs/identity.md says why).

The roles the mapping gives are the whole truth for a user who signs in
this way: a membership granted by hand is replaced at their next sign-in
or recheck.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import sso
from gpuclusters.core.errors import AuthenticationError, InvalidStateError, UnavailableError
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.sso_sessions import (
    LOGIN_TTL,
    apply_grants,
    end_session,
    grants_from_claims,
)
from gpuclusters.server.db.models import (
    ApiKey,
    Organization,
    SsoLogin,
    SsoSession,
    User,
    utcnow,
)
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.keys import display_prefix, hash_key, new_key
from gpuclusters.server.security.oidc import (
    DeviceStart,
    OidcClient,
    OidcError,
    OidcUnavailableError,
    Pending,
    Tokens,
    pkce_pair,
)
from gpuclusters.server.services.tenancy import DEFAULT_ORG, RESERVED_USER_NAMES, next_uid

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SignedIn:
    user: User
    key: str
    key_row: ApiKey
    session: SsoSession


def client(rt: Runtime) -> OidcClient:
    if rt.oidc is None:
        raise InvalidStateError(
            "single sign-on is not configured on this server (GPUCLUSTERS_SSO_ISSUER); "
            "sign in with an API key"
        )
    return rt.oidc


async def _organization(session: AsyncSession) -> Organization:
    org = await session.scalar(select(Organization).where(Organization.name == DEFAULT_ORG))
    if org is None:
        raise InvalidStateError("the server has no organization yet (start it once)")
    return org


async def _free_name(session: AsyncSession, org_id: str, wanted: str) -> str:
    """``wanted``, or the first of ``wanted-2``, ``wanted-3``, ... nobody has
    had (deleted users keep their names)."""
    n = 1
    name = wanted
    while name in RESERVED_USER_NAMES or await session.scalar(
        select(User.id).where(User.organization_id == org_id, User.name == name)
    ):
        n += 1
        name = sso.numbered(wanted, n)
    return name


async def _user_for(session: AsyncSession, rt: Runtime, claims: dict[str, Any]) -> User:
    org = await _organization(session)
    subject = str(claims["sub"])
    user = await session.scalar(
        select(User).where(User.organization_id == org.id, User.sso_subject == subject)
    )
    if user is not None:
        if user.deleted_at is not None:
            raise AuthenticationError(
                f"user {user.name} was deleted by an organization admin; ask them"
            )
        return user
    wanted = sso.name_from_claims(claims, rt.settings.sso_username_claim)
    if not wanted:
        raise AuthenticationError(
            f"the identity provider's token gives no usable user name "
            f"({rt.settings.sso_username_claim}, preferred_username or email)"
        )
    user = User(
        organization_id=org.id,
        name=await _free_name(session, org.id, wanted),
        is_admin=False,
        uid=await next_uid(session, org.id),
        sso_subject=subject,
    )
    session.add(user)
    await session.flush()
    log.info("single sign-on: new user %s (subject %s)", user.name, subject)
    return user


async def sign_in(session: AsyncSession, rt: Runtime, tokens: Tokens, *, via: str) -> SignedIn:
    """Open a session for the signed-in user (the caller has verified the
    tokens); commits."""
    if tokens.refresh_token is None:
        raise AuthenticationError(
            "the identity provider gave no refresh token: add offline_access to "
            "GPUCLUSTERS_SSO_SCOPES and allow it for this client"
        )
    user = await _user_for(session, rt, tokens.claims)
    changed = await apply_grants(session, rt, user, grants_from_claims(rt, tokens.claims))
    now = utcnow()
    expires = now + timedelta(hours=rt.settings.sso_session_ttl_h)
    key = new_key()
    key_row = ApiKey(
        user_id=user.id, key_prefix=display_prefix(key), key_hash=hash_key(key), expires_at=expires
    )
    session.add(key_row)
    await session.flush()
    row = SsoSession(
        user_id=user.id,
        api_key_id=key_row.id,
        via=via,
        refresh_token=tokens.refresh_token,
        created_at=now,
        expires_at=expires,
        checked_at=now,
    )
    session.add(row)
    await session.commit()
    if changed:
        rt.hints.notify(hints.ACCESS)
    log.info("single sign-on: %s signed in (%s)", user.name, via)
    return SignedIn(user=user, key=key, key_row=key_row, session=row)


async def sign_out(session: AsyncSession, *, key_id: str) -> bool:
    """End the session whose key is ``key_id`` (the caller's own); whether
    there was one. An API key that is not a session's is left alone."""
    row = await session.scalar(
        select(SsoSession).where(SsoSession.api_key_id == key_id, SsoSession.ended_at.is_(None))
    )
    if row is None:
        return False
    await end_session(session, row, "signed out", utcnow())
    await session.commit()
    return True


# --- the CLI: the device flow (RFC 8628) -------------------------------------------


async def start_device(rt: Runtime) -> DeviceStart:
    try:
        return await client(rt).start_device()
    except OidcUnavailableError as exc:
        raise UnavailableError(str(exc)) from exc


async def poll_device(session: AsyncSession, rt: Runtime, device_code: str) -> SignedIn | Pending:
    try:
        got = await client(rt).poll_device(device_code)
    except OidcUnavailableError as exc:
        raise UnavailableError(str(exc)) from exc
    except OidcError as exc:
        raise AuthenticationError(f"single sign-on failed: {exc}") from exc
    if isinstance(got, Pending):
        return got
    return await sign_in(session, rt, got, via="cli")


# --- the console: the authorization-code flow with PKCE ------------------------------


def _state_hash(state: str) -> str:
    return hashlib.sha256(state.encode()).hexdigest()


async def start_console_login(session: AsyncSession, rt: Runtime, *, redirect_uri: str) -> str:
    """Where to send the browser: the provider's sign-in page."""
    oidc = client(rt)
    state = secrets.token_urlsafe(32)
    nonce = secrets.token_urlsafe(24)
    verifier, challenge = pkce_pair()
    session.add(SsoLogin(state_hash=_state_hash(state), verifier=verifier, nonce=nonce))
    await session.commit()
    try:
        return await oidc.authorization_url(
            redirect_uri=redirect_uri, state=state, nonce=nonce, code_challenge=challenge
        )
    except OidcUnavailableError as exc:
        raise UnavailableError(str(exc)) from exc


async def finish_console_login(
    session: AsyncSession, rt: Runtime, *, state: str, code: str, redirect_uri: str
) -> SignedIn:
    """The provider sent the browser back: exchange the code (once: the
    state is used up), verify, sign in."""
    oidc = client(rt)
    pending = await session.get(SsoLogin, _state_hash(state))
    if pending is None or pending.created_at < utcnow() - LOGIN_TTL:
        raise AuthenticationError("this sign-in is unknown or too old: start again")
    await session.delete(pending)
    await session.commit()
    try:
        tokens = await oidc.exchange_code(
            code=code, redirect_uri=redirect_uri, verifier=pending.verifier, nonce=pending.nonce
        )
    except OidcUnavailableError as exc:
        raise UnavailableError(str(exc)) from exc
    except OidcError as exc:
        raise AuthenticationError(f"single sign-on failed: {exc}") from exc
    return await sign_in(session, rt, tokens, via="console")
