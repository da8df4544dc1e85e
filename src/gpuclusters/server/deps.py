"""FastAPI dependencies: the runtime, a database session per request, and the
authenticated caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.server.audit_log import remember_principal
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy


def get_runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


async def get_session(rt: Annotated[Runtime, Depends(get_runtime)]) -> AsyncIterator[AsyncSession]:
    async with rt.request_sessionmaker() as session:
        yield session


# Declared as a security scheme so that the OpenAPI document says which
# operations need a key; a missing or malformed header is left to
# `tenancy.authenticate`, which answers 401 in the API's error shape.
bearer = HTTPBearer(auto_error=False, description="an API key")


async def get_principal(
    request: Request,
    session: Annotated[AsyncSession, Depends(get_session)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    key = credentials.credentials.strip() if credentials is not None else None
    principal = await tenancy.authenticate(session, key=key or None)
    remember_principal(request.state, principal)  # for the audit log
    return principal


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
