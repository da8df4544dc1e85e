"""``GET /v1/registry/token``: the image registry's token endpoint (its
``realm``, Docker token protocol). Clients send HTTP Basic credentials (a
user name and API key, or a cluster's pull credential) and the scopes they
want; the answer is a bearer token for the registry listing what they may
do (docs/kubernetes.md "Images")."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from gpuclusters.core import models as api
from gpuclusters.core.errors import NotFoundError
from gpuclusters.core.models import ErrorBody
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.services import registry

router = APIRouter(prefix="/v1/registry")


class RegistryToken(BaseModel):
    token: str
    access_token: str
    expires_in: int
    issued_at: str


_NO_REGISTRY: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "this server runs no image registry"}
}


@router.get("/token", response_model=RegistryToken, responses=_NO_REGISTRY)
async def token(
    request: Request,
    rt: RuntimeDep,
    session: SessionDep,
    service: Annotated[str | None, Query(description="the registry's service name")] = None,
    scope: Annotated[
        list[str] | None, Query(description="repository:NAME:pull,push (repeatable)")
    ] = None,
) -> RegistryToken:
    """A bearer token for the registry; ``unauthenticated`` for wrong credentials."""
    if rt.registry is None:
        raise NotFoundError("this server runs no image registry")
    issued = await registry.issue_token(
        session,
        rt.registry.keys,
        authorization=request.headers.get("authorization", ""),
        service=service,
        scopes=scope or [],
    )
    at = datetime.fromtimestamp(issued.issued_at, UTC).isoformat().replace("+00:00", "Z")
    return RegistryToken(
        token=issued.token, access_token=issued.token, expires_in=issued.expires_in, issued_at=at
    )


@router.get("", response_model=api.RegistryInfo, responses=_NO_REGISTRY)
async def registry_info(rt: RuntimeDep, principal: PrincipalDep) -> api.RegistryInfo:
    """Where the registry is, for ``gpuclusters registry login``."""
    if rt.registry is None:
        raise NotFoundError("this server runs no image registry")
    return api.RegistryInfo(
        address=rt.settings.registry_address,
        token_url=rt.settings.registry_token_url,
        ca_pem=rt.registry.ca_pem,
    )
