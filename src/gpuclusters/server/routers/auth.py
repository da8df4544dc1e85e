"""Single sign-on for the CLI (the device flow) and signing out
(``services/sso.py``; the console's flow is in ``routers/console.py``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from gpuclusters.core import models as api
from gpuclusters.server.audit_log import remember_principal
from gpuclusters.server.db.models import ApiKey
from gpuclusters.server.deps import RuntimeDep, SessionDep, bearer
from gpuclusters.server.security.keys import hash_key
from gpuclusters.server.security.oidc import Pending
from gpuclusters.server.services import sso, tenancy

router = APIRouter(prefix="/v1/auth")

SSO_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {"description": "single sign-on is not configured on this server"},
    503: {"description": "the identity provider does not answer"},
}


@router.get("/sso", response_model=api.SsoInfo)
async def sso_info(rt: RuntimeDep) -> api.SsoInfo:
    """Whether this server signs users in through an identity provider (no
    key needed: the CLI asks before it has one)."""
    return api.SsoInfo(enabled=rt.oidc is not None, issuer=rt.settings.sso_issuer)


@router.post("/sso/device", response_model=api.SsoDeviceStart, responses=SSO_ERRORS)
async def start_device(rt: RuntimeDep) -> api.SsoDeviceStart:
    """Start signing in from a device: the identity provider's page and code
    for the user to open and enter."""
    got = await sso.start_device(rt)
    return api.SsoDeviceStart(
        device_code=got.device_code,
        user_code=got.user_code,
        verification_uri=got.verification_uri,
        verification_uri_complete=got.verification_uri_complete,
        interval=got.interval,
        expires_in=got.expires_in,
    )


@router.post(
    "/sso/device/token",
    response_model=api.SsoSignedIn,
    responses={202: {"model": api.SsoPending, "description": "not signed in yet"}, **SSO_ERRORS},
)
async def poll_device(
    body: api.SsoDevicePoll, request: Request, session: SessionDep, rt: RuntimeDep
) -> Any:
    """Poll until the user has signed in at the identity provider: 202 while
    pending, then the session (its API key)."""
    got = await sso.poll_device(session, rt, body.device_code)
    if isinstance(got, Pending):
        pending = api.SsoPending(
            status="slow_down" if got.slow_down else "pending",
            interval=5 + (5 if got.slow_down else 0),
        )
        return JSONResponse(pending.model_dump(), status_code=202)
    principal, _ = await tenancy.principal_for_key(session, ApiKey.id == got.key_row.id)
    remember_principal(request.state, principal)  # for the audit log
    me = await tenancy.whoami(session, principal=principal)
    assert got.key_row.expires_at is not None
    return api.SsoSignedIn(
        user=got.user.name,
        key=got.key,
        key_prefix=got.key_row.key_prefix,
        expires_at=got.key_row.expires_at,
        is_admin=me.is_admin,
        projects=me.projects,
    )


@router.post("/logout", status_code=204)
async def logout(
    request: Request,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Response:
    """End the caller's single sign-on session (its key stops working). An
    API key that is not a session's is left alone: revoke those with
    ``DELETE /v1/users/{name}``."""
    key = credentials.credentials.strip() if credentials is not None else None
    if not key:
        await tenancy.authenticate(session, key=None)  # 401, in the API's words
    assert key is not None
    principal, key_row = await tenancy.principal_for_key(session, ApiKey.key_hash == hash_key(key))
    remember_principal(request.state, principal)
    await sso.sign_out(session, key_id=key_row.id)
    return Response(status_code=204)
