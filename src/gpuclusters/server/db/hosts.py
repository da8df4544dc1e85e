"""The providers' view of hosts with agents (``providers.hosts.HostDirectory``),
read from the hosts table."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuclusters.core.enums import HostAgentStatus
from gpuclusters.providers.hosts.provider import HostEndpoint
from gpuclusters.server.db.models import Host


class DbHostDirectory:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    @staticmethod
    def _endpoint(h: Host) -> HostEndpoint | None:
        if h.address is None or h.agent_port is None:
            return None
        return HostEndpoint(name=h.name, address=h.address, port=h.agent_port)

    async def endpoint(self, name: str) -> HostEndpoint | None:
        async with self._sessionmaker() as session:
            host = await session.scalar(
                select(Host).where(
                    Host.name == name,
                    Host.agent_status.is_not(None),
                    Host.agent_status != HostAgentStatus.REMOVED.value,
                )
            )
        return self._endpoint(host) if host is not None else None

    async def endpoints(self) -> list[HostEndpoint]:
        async with self._sessionmaker() as session:
            hosts = await session.scalars(
                select(Host)
                .where(
                    Host.agent_status.is_not(None),
                    Host.agent_status != HostAgentStatus.REMOVED.value,
                )
                .order_by(Host.name)
            )
            found = [self._endpoint(h) for h in hosts]
        return [ep for ep in found if ep is not None]
