"""FastAPI dependencies: the runtime, a database session per request, and the
authenticated caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy


def get_runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


async def get_session(rt: Annotated[Runtime, Depends(get_runtime)]) -> AsyncIterator[AsyncSession]:
    async with rt.sessionmaker() as session:
        yield session


async def get_principal(
    request: Request, session: Annotated[AsyncSession, Depends(get_session)]
) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    return await tenancy.authenticate(
        session, key=key.strip() if scheme.lower() == "bearer" else None
    )


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
