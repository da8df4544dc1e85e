"""Hosts with host agents (docs/hosts.md): join tokens and removal for org
admins; join and heartbeats for the agents themselves, which authenticate
with their join token and then their host secret, never an API key."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gpuclusters.core import models as api
from gpuclusters.core.errors import ValidationError
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.services import hosts

router = APIRouter(prefix="/v1/hosts")


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@router.post("/join-tokens", response_model=api.HostJoinToken, status_code=201)
async def create_join_token(
    body: api.HostJoinTokenCreate, session: SessionDep, rt: RuntimeDep, principal: PrincipalDep
) -> api.HostJoinToken:
    return await hosts.create_join_token(session, rt=rt, principal=principal, body=body)


@router.post("/join", response_model=api.HostJoined)
async def join(body: api.HostJoin, session: SessionDep, rt: RuntimeDep) -> api.HostJoined:
    return await hosts.join(session, rt=rt, body=body)


@router.post("/{name}/heartbeat", status_code=204, include_in_schema=False)
async def heartbeat(
    name: str, body: api.HostHeartbeat, request: Request, session: SessionDep, rt: RuntimeDep
) -> Response:
    await hosts.heartbeat(session, rt=rt, name=name, secret=_bearer(request), body=body)
    return Response(status_code=204)


@router.post("/{name}/drain", response_model=api.Host)
async def drain(
    name: str, session: SessionDep, rt: RuntimeDep, principal: PrincipalDep
) -> api.Host:
    return await hosts.drain_host(session, rt=rt, principal=principal, name=name)


@router.delete("/{name}", response_model=api.Host)
async def remove(
    name: str,
    session: SessionDep,
    rt: RuntimeDep,
    principal: PrincipalDep,
    force: bool = False,
    reason: str | None = None,
) -> api.Host:
    """``force`` (with a ``reason``): a host gone for good is removed with
    the nodes on it, which fail with the reason."""
    if reason is not None and not force:
        raise ValidationError("reason: only with force=true", field="reason")
    return await hosts.remove_host(
        session,
        rt=rt,
        principal=principal,
        name=name,
        force_reason=(reason or "") if force else None,
    )
