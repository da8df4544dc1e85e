"""Lifecycle events expire after the retention period (72 h by default)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from gpuclusters.server.controllers.housekeeping import expire_events
from gpuclusters.server.db.models import NodeEvent, utcnow
from support.api import ApiHarness

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    # Only this test's explicit call may expire events, not the background loop.
    return {"housekeeping_interval_s": 3600}


async def test_old_events_expire(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "demo", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201
    await api.wait_cluster("demo", {"ready"})
    rt = api.runtime
    async with rt.sessionmaker() as s:
        first = (await s.scalars(select(NodeEvent))).first()
        assert first is not None
        await s.execute(
            update(NodeEvent)
            .where(NodeEvent.id == first.id)
            .values(timestamp=utcnow() - timedelta(hours=73))
        )
        await s.commit()
    assert await expire_events(rt) == 1
    events = (await api.client.get(f"{P}/events", params={"limit": 1000})).json()
    assert len(events) == 1 and events[0]["node"] != first.node_name
