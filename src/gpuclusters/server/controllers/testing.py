"""Drive one reconciler handler for one row, without the whole app: a
database (SQLite file or PostgreSQL), row factories, a runtime whose
provider and layers are the scripted ones that ship beside their contracts
(``providers/testing.py``, ``layers/testing.py``), and the node and cluster
reconcilers on it. Shipped in the package, as httpx ships its mock
transport, for this project's tests and for anyone extending a reconciler.

    async with ControllerHarness.open(tmp_path) as h:
        cluster = await h.rows.cluster(status="waiting_for_control_plane")
        node = await h.rows.node(cluster, phase="bootstrapping")
        h.layer.script("join_node", LayerError("slurmd did not register"))
        assert await h.nodes.work_on(node.id)           # the engine's path
        row = await h.node(node.id)
        assert row.retries == 1 and "slurmd" in row.last_error
        outcome = await h.step(h.nodes, node.id)       # one step, its outcome
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuclusters.core.enums import ClusterType
from gpuclusters.layers.testing import ScriptedLayer
from gpuclusters.providers.testing import ScriptedProvider
from gpuclusters.providers.volumes import VolumeStore
from gpuclusters.server.controllers import leases
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.clusters import ClusterReconciler
from gpuclusters.server.controllers.hints import Hints
from gpuclusters.server.controllers.nodes import NodeReconciler
from gpuclusters.server.controllers.outcomes import Outcome, of
from gpuclusters.server.db.engine import make_engine, make_sessionmaker
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.models import Cluster, Host, Node, Organization, Project, utcnow
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.settings import Settings

__all__ = ["ControllerHarness", "RowFactory", "ScriptedLayer", "ScriptedProvider"]


class RowFactory:
    """Rows with sensible defaults; keyword arguments set any column."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sm = sessionmaker
        self._n = itertools.count(1)
        self._project: Project | None = None

    async def _add(self, row: Any) -> Any:
        async with self._sm() as session:
            session.add(row)
            await session.commit()
        return row

    async def project(self) -> Project:
        if self._project is None:
            org = await self._add(Organization(name=f"org{next(self._n)}"))
            self._project = await self._add(
                Project(organization_id=org.id, name="default", id_block=next(self._n))
            )
        return self._project

    async def host(self, name: str | None = None, **columns: Any) -> Host:
        values: dict[str, Any] = {
            "name": name or f"h{next(self._n):03d}",
            "region": "local-1",
            "gpu_type": "H100_SXM",
            "nvme_gib": 7680,
            "ib_island": "ib-a",
        }
        values.update(columns)
        row: Host = await self._add(Host(**values))
        return row

    async def cluster(self, name: str | None = None, **columns: Any) -> Cluster:
        project = await self.project()
        values: dict[str, Any] = {
            "project_id": project.id,
            "name": name or f"c{next(self._n)}",
            "cluster_type": "slurm",
            "gpu_type": "H100_SXM",
            "region": "local-1",
            "num_gpus": 8,
            "billing_type": "on_demand",
            "status": "queued",
        }
        values.update(columns)
        row: Cluster = await self._add(Cluster(**values))
        return row

    async def node(self, cluster: Cluster, host: Host | None = None, **columns: Any) -> Node:
        if host is None and "host_id" not in columns:
            host = await self.host()
        values: dict[str, Any] = {
            "cluster_id": cluster.id,
            "project_id": cluster.project_id,
            "name": f"{cluster.name}-standard-{secrets.token_hex(3)}",
            "compute_class": "standard",
            "phase": "pending",
            "host_id": host.id if host is not None else None,
            "phase_changed_at": utcnow(),
        }
        values.update(columns)
        row: Node = await self._add(Node(**values))
        return row


class ControllerHarness:
    def __init__(
        self,
        rt: Runtime,
        ctx: ControllerContext,
        provider: ScriptedProvider,
        layer: ScriptedLayer,
    ) -> None:
        self.rt = rt
        self.ctx = ctx
        self.provider = provider
        self.layer = layer
        self.rows = RowFactory(rt.sessionmaker)
        self.nodes = NodeReconciler(ctx, rt, drain_timeout_s=rt.settings.preemption_grace_s)
        self.clusters = ClusterReconciler(ctx, rt)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        home: Path,
        *,
        database_url: str | None = None,
        owner: str = "harness",
        lease_ttl_s: float = 30.0,
        **settings: Any,
    ) -> AsyncIterator[ControllerHarness]:
        """A harness on a fresh database (``database_url``, else a SQLite
        file in ``home``); ``settings`` override the server's settings."""
        url = database_url or f"sqlite+aiosqlite:///{home / 'harness.sqlite'}"
        values: dict[str, Any] = {
            "home": home,
            "database_url": url,
            "provider": "fake",
            "acceptance_checks": [],
            "lease_ttl_s": lease_ttl_s,
        }
        values.update(settings)
        config = Settings(**values)
        engine = make_engine(url)
        await upgrade_to_head(engine)
        provider = ScriptedProvider()
        layer = ScriptedLayer()
        rt = Runtime(
            settings=config,
            engine=engine,
            sessionmaker=make_sessionmaker(engine),
            provider=provider,
            volumes=VolumeStore(home / "volumes"),
            layers={ClusterType.KUBERNETES: layer, ClusterType.SLURM: layer},
        )
        rt.nodes_snapshot_taken = True  # nothing ran before: nothing to verify
        ctx = ControllerContext(
            sessionmaker=rt.sessionmaker,
            hints=Hints(),
            owner=owner,
            lease_ttl_s=config.lease_ttl_s,
            interval_s=config.reconcile_interval_s,
            concurrency=config.controller_concurrency,
            backoff_base_s=config.retry_backoff_base_s,
            backoff_cap_s=config.retry_backoff_cap_s,
        )
        try:
            yield cls(rt, ctx, provider, layer)
        finally:
            await engine.dispose()

    async def step(self, reconciler: SteppedReconciler, row_id: str) -> Outcome:
        """Claim the row, take one step of the handler for its phase and
        return its outcome (exceptions propagate: the engine would record
        them), then release the lease."""
        async with self.rt.sessionmaker() as session:
            token = await leases.claim(
                session, reconciler.model, row_id, owner=self.ctx.owner, ttl_s=self.ctx.lease_ttl_s
            )
        assert token is not None, f"{row_id} is leased or waiting for its next attempt"
        try:
            result = await reconciler.step(row_id, token)
        finally:
            async with self.rt.sessionmaker() as session:
                await leases.release(session, reconciler.model, row_id, token=token)
        return of(result) if isinstance(result, bool) else result

    async def node(self, row_id: str) -> Node:
        async with self.rt.sessionmaker() as session:
            return await session.get_one(Node, row_id)

    async def cluster(self, row_id: str) -> Cluster:
        async with self.rt.sessionmaker() as session:
            return await session.get_one(Cluster, row_id)

    async def skip_backoff(self, model: leases.LeasedModel, row_id: str) -> None:
        """Make a row's next attempt due now (as if its backoff had passed)."""
        async with self.rt.sessionmaker() as session:
            await session.execute(
                update(model).where(model.id == row_id).values(next_attempt_at=None)
            )
            await session.commit()

    async def age(self, model: type[Node] | type[Cluster], row_id: str, seconds: float) -> None:
        """Move a row's phase deadline ``seconds`` earlier (time passing)."""
        async with self.rt.sessionmaker() as session:
            row: Node | Cluster = await session.get_one(model, row_id)
            if row.phase_deadline_at is not None:
                row.phase_deadline_at -= timedelta(seconds=seconds)
            if isinstance(row, Node):
                row.phase_changed_at -= timedelta(seconds=seconds)
            await session.commit()
