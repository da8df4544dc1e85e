"""Internal endpoints for node agents (``/agent/v1``); served on the same
app, reached by agents through the unix socket mounted into their node."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gpuclusters.core import models as api
from gpuclusters.server.deps import RuntimeDep, SessionDep
from gpuclusters.server.services import agents

router = APIRouter(prefix="/agent/v1", include_in_schema=False)


@router.post("/heartbeat", status_code=204)
async def heartbeat(
    body: api.AgentHeartbeat, request: Request, session: SessionDep, rt: RuntimeDep
) -> Response:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    await agents.heartbeat(
        session, rt=rt, token=token.strip() if scheme.lower() == "bearer" else None, body=body
    )
    return Response(status_code=204)
