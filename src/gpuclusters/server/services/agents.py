"""The node agents' side of the API (internal, not under /v1): heartbeats.

An agent proves which node it is with the token the control plane wrote
into that node while it bootstrapped; only the token's SHA-256 is stored.
"""

from __future__ import annotations

import hmac
import time

from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import NodePhase
from gpuclusters.core.errors import AuthenticationError
from gpuclusters.core.telemetry import GpuSample
from gpuclusters.server.controllers.alerts import apply_findings
from gpuclusters.server.db.models import Node, utcnow
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.keys import hash_key


async def heartbeat(
    session: AsyncSession, *, rt: Runtime, token: str | None, body: api.AgentHeartbeat
) -> None:
    node = await session.get(Node, body.node_id)
    expected = node.agent_token_hash if node is not None else None
    if (
        node is None
        or node.deleted_at is not None
        or not token
        or expected is None
        or not hmac.compare_digest(expected, hash_key(token))
    ):
        raise AuthenticationError("unknown node or bad agent token")
    node.last_heartbeat_at = utcnow()
    if body.telemetry is not None:
        try:
            samples = [GpuSample.from_dict(d) for d in body.telemetry]
        except (KeyError, TypeError, ValueError):
            samples = []  # an agent's bad sample never fails its heartbeat
        # The server's clock: hosts' clocks may differ, the charts' axis may not.
        rt.telemetry.record(node.id, time.time(), samples)
    if body.gpu_backend:
        node.gpu_backend = body.gpu_backend
    # Findings count from a node that runs (a booting or repairing node's
    # state is in flux; its alerts wait for it to be back).
    if body.findings is not None and node.phase == NodePhase.RUNNING.value:
        await apply_findings(session, rt=rt, node=node, findings=body.findings)
    await session.commit()
