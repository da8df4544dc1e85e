"""Gateway ports (server/db/gateway.py): lowest free first, kept for the
cluster's life, free again once it is deleted, a clear error when the
range is used up, and the database refuses two live clusters on one port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.errors import CapacityUnavailableError
from gpuclusters.server.db.engine import make_engine, make_sessionmaker
from gpuclusters.server.db.gateway import assign_ports
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.models import Cluster, Organization, Project, utcnow


def cluster(project: Project, name: str, kind: str = "slurm") -> Cluster:
    return Cluster(
        project_id=project.id, name=name, cluster_type=kind, gpu_type="H100_SXM",
        region="local-1", num_gpus=8, billing_type="on_demand", status="queued",
    )  # fmt: skip


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[tuple[AsyncSession, Project]]:
    """A migrated SQLite database with one project; disposed afterwards (its
    driver's thread must not outlive the test's event loop)."""
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    await upgrade_to_head(engine)
    session = make_sessionmaker(engine)()
    try:
        org = Organization(name="o")
        session.add(org)
        await session.flush()
        project = Project(organization_id=org.id, name="p", id_block=0)
        session.add(project)
        await session.flush()
        yield session, project
    finally:
        await session.close()
        await engine.dispose()


async def test_ports_are_given_lowest_first_and_freed_by_a_delete(
    db: tuple[AsyncSession, Project],
) -> None:
    session, project = db
    a, b = cluster(project, "a"), cluster(project, "b", "kubernetes")
    session.add_all([a, b])
    await session.flush()
    assert await assign_ports(session, a, host="gw", port_range=(30000, 30010))
    assert (a.kubernetes_port, a.ssh_port, a.gateway_host) == (30000, 30001, "gw")
    assert await assign_ports(session, b, host="gw", port_range=(30000, 30010))
    assert (b.kubernetes_port, b.ssh_port) == (30002, None)  # no login node to reach
    # Kept: a second call changes nothing, unless the public host changed.
    assert not await assign_ports(session, a, host="gw", port_range=(30000, 30010))
    assert await assign_ports(session, a, host="gw2", port_range=(30000, 30010))
    assert (a.kubernetes_port, a.ssh_port) == (30000, 30001)
    a.deleted_at = utcnow()
    await session.flush()
    c = cluster(project, "c")
    session.add(c)
    await session.flush()
    await assign_ports(session, c, host="gw", port_range=(30000, 30010))
    assert (c.kubernetes_port, c.ssh_port) == (30000, 30001)


async def test_a_full_range_is_a_clear_error(db: tuple[AsyncSession, Project]) -> None:
    session, project = db
    a, b = cluster(project, "a"), cluster(project, "b")
    session.add_all([a, b])
    await session.flush()
    await assign_ports(session, a, host="gw", port_range=(30000, 30002))
    with pytest.raises(CapacityUnavailableError, match="no free gateway port in 30000-30002"):
        await assign_ports(session, b, host="gw", port_range=(30000, 30002))


async def test_two_live_clusters_cannot_share_a_port(db: tuple[AsyncSession, Project]) -> None:
    session, project = db
    a, b = cluster(project, "a"), cluster(project, "b")
    a.ssh_port = b.ssh_port = 30005
    session.add_all([a, b])
    with pytest.raises(IntegrityError):
        await session.flush()
