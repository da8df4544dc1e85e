"""The reconcile loop's queue (``controllers/base.py``): a pass claims only
the room it has; what found no room waits in order, and each task that ends
hands the next rows to a targeted pass, so a burst costs a query for a few
ids per step started rather than a scan of every candidate. Rows go in the
reconciler's ``rank`` order (nodes: oldest first)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.server.controllers.base import ControllerContext, Reconciler
from gpuclusters.server.controllers.hints import Hints
from gpuclusters.server.controllers.testing import ControllerHarness
from gpuclusters.server.db.models import Node, utcnow


class Recording(Reconciler):
    """Every live pending node is a candidate until it has been worked on
    once; each step waits until the test lets it go."""

    name = "recording"
    model = Node

    def __init__(self, ctx: ControllerContext, rank: dict[str, int]) -> None:
        super().__init__(ctx)
        self.order = rank
        self.done: list[str] = []
        self.started: list[str] = []
        self.full_scans = 0
        self.targeted: list[set[str]] = []
        self.go = asyncio.Event()

    def rank(self, row_id: str) -> tuple[int, str]:
        return (self.order[row_id], row_id)

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        self.full_scans += 1
        ids = await session.scalars(select(Node.id).where(Node.deleted_at.is_(None)))
        return [i for i in ids if i not in self.done]

    async def candidates_among(self, session: AsyncSession, ids: set[str]) -> Sequence[str]:
        self.targeted.append(set(ids))
        return [i for i in ids if i not in self.done]

    async def reconcile(self, row_id: str, token: str) -> bool:
        self.started.append(row_id)
        await self.go.wait()
        self.go.clear()
        self.done.append(row_id)
        return False


async def test_rows_without_room_wait_in_order_and_go_by_targeted_passes(
    tmp_path: Path,
) -> None:
    async with ControllerHarness.open(tmp_path) as h:
        cluster = await h.rows.cluster()
        t0 = utcnow()
        # Made in one order, ranked in another (newest first here).
        nodes = [await h.rows.node(cluster, created_at=t0 + timedelta(seconds=i)) for i in range(7)]
        rank = {n.id: -i for i, n in enumerate(nodes)}
        expected = [n.id for n in reversed(nodes)]
        ctx = ControllerContext(
            sessionmaker=h.rt.sessionmaker,
            hints=Hints(),
            owner="loop-test",
            lease_ttl_s=30.0,
            interval_s=3600.0,  # no second full pass: only the queue can go on
            concurrency=1,  # room for 2 claimed rows at a time
        )
        r = Recording(ctx, rank)
        r.start()
        try:
            for n in range(1, len(nodes) + 1):
                await _until(lambda n=n: len(r.started) >= n)
                # Never more claimed than the room (one running, one ready).
                assert len(r._inflight) <= 2
                r.go.set()
                await _until(lambda n=n: len(r.done) >= n)
        finally:
            r.go.set()
            await r.stop()
        assert r.started == expected  # by rank, one after another
        assert r.full_scans == 1  # the first pass; the rest were targeted
        assert r.targeted and all(len(ids) <= 3 for ids in r.targeted)


class HintedOnly(Recording):
    """Rows a full pass does not list (as clusters that only wait for their
    nodes): they come in by hints naming them."""

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        self.full_scans += 1
        return []


async def test_a_full_pass_keeps_the_hinted_rows_queued_before_it(tmp_path: Path) -> None:
    async with ControllerHarness.open(tmp_path) as h:
        cluster = await h.rows.cluster()
        nodes = [await h.rows.node(cluster) for _ in range(4)]
        ctx = ControllerContext(
            sessionmaker=h.rt.sessionmaker,
            hints=Hints(),
            owner="loop-test",
            lease_ttl_s=30.0,
            interval_s=3600.0,
            concurrency=1,  # room for 2 claimed rows at a time
        )
        r = HintedOnly(ctx, {n.id: i for i, n in enumerate(nodes)})
        r.start()
        try:
            await _until(lambda: r.full_scans == 1)  # the first pass: nothing listed
            ctx.hints.notify_rows(r.name, [n.id for n in nodes])
            await _until(lambda: len(r.started) == 1)
            assert len(r._queue) == 2  # two claimed (one running), two queued
            ctx.hints.notify(r.name)  # a full pass, which lists none of them
            await _until(lambda: r.full_scans == 2)
            for n in range(1, len(nodes) + 1):
                await _until(lambda n=n: len(r.started) >= n)
                r.go.set()
                await _until(lambda n=n: len(r.done) >= n)
        finally:
            r.go.set()
            await r.stop()
        assert sorted(r.done) == sorted(n.id for n in nodes)


async def _until(check: object) -> None:
    """Poll ``check`` for up to 10 s."""
    assert callable(check)
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")
