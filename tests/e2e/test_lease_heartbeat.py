"""Leases cannot run out under a step (controllers/base.py's heartbeat), on
PostgreSQL with two replicas in two processes.

Replica A (tests/support/lease_replica.py) claims a cluster whose
control-plane step blocks for 3 x the lease TTL. Replica B (this process)
tries to claim it all along and must never get it; A's step runs once.
When A is killed with SIGKILL in the middle of such a step, B takes the row
over once the lease runs out: within one TTL and one pass. And with the
heartbeat turned off (the engine before it), B does claim the row under A's
running step: the test can fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuclusters.server.controllers.testing import ControllerHarness
from support.postgres import PostgresServer

pytestmark = [pytest.mark.postgres]

TTL_S = 1.5
PASS_S = 0.1  # how often replica B tries
REPLICA = Path(__file__).parent.parent / "support" / "lease_replica.py"


@pytest.fixture
async def b(postgres_server: PostgresServer, tmp_path: Path) -> AsyncIterator[ControllerHarness]:
    with postgres_server.temporary_database("leases") as url:
        async with ControllerHarness.open(
            tmp_path / "b", database_url=url, owner="replica-b", lease_ttl_s=TTL_S
        ) as harness:
            yield harness


def start_a(
    b: ControllerHarness, tmp_path: Path, row_id: str, block_s: float, *extra: str
) -> subprocess.Popen[str]:
    home = tmp_path / "a"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [
            sys.executable,
            str(REPLICA),
            str(b.rt.settings.database_url),
            str(home),
            row_id,
            str(block_s),
            str(TTL_S),
            *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


async def owner(b: ControllerHarness, row_id: str) -> str | None:
    return (await b.cluster(row_id)).lock_owner


async def wait_for_a(b: ControllerHarness, row_id: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while await owner(b, row_id) != "replica-a":
        assert proc.poll() is None, "replica A exited before it claimed the row"
        assert time.monotonic() < deadline, "replica A never claimed the row"
        await asyncio.sleep(0.05)


async def claims_during(b: ControllerHarness, row_id: str, seconds: float) -> list[float]:
    """Try to claim the row every pass for ``seconds``; when it worked."""
    got: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if await b.clusters.work_on(row_id):
            got.append(time.monotonic() - start)
        await asyncio.sleep(PASS_S)
    return got


async def test_a_step_three_ttls_long_is_never_claimed_by_the_other_replica(
    b: ControllerHarness, tmp_path: Path
) -> None:
    cluster = await b.rows.cluster(status="waiting_for_control_plane")
    a = start_a(b, tmp_path, cluster.id, 3 * TTL_S)
    try:
        await wait_for_a(b, cluster.id, a)
        expiries = []
        got = []
        start = time.monotonic()
        while time.monotonic() - start < 3 * TTL_S - 0.5:
            if await b.clusters.work_on(cluster.id):
                got.append(time.monotonic() - start)
            expiries.append((await b.cluster(cluster.id)).lock_expires_at)
            await asyncio.sleep(PASS_S)
        assert got == [], f"replica B claimed the row under A's step at {got}"
        # The heartbeat pushed the expiry out while the step ran.
        assert len({e for e in expiries if e is not None}) >= 3, expiries
        out, _ = a.communicate(timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert out.strip() == "done"
    row = await b.cluster(cluster.id)
    assert row.status == "waiting_for_nodes" and row.lock_owner is None  # went on
    assert b.layer.calls_to("ensure_control_plane") == []  # B never ran the step


async def test_the_other_replica_takes_over_within_a_ttl_of_a_kill(
    b: ControllerHarness, tmp_path: Path
) -> None:
    cluster = await b.rows.cluster(status="waiting_for_control_plane")
    a = start_a(b, tmp_path, cluster.id, 600)
    try:
        await wait_for_a(b, cluster.id, a)
        await asyncio.sleep(TTL_S)  # a heartbeat or two
        assert not await b.clusters.work_on(cluster.id)
        a.send_signal(signal.SIGKILL)
        a.wait()
        killed = time.monotonic()
        while not await b.clusters.work_on(cluster.id):
            assert time.monotonic() - killed < 30, "replica B never took the row over"
            await asyncio.sleep(PASS_S)
        took = time.monotonic() - killed
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    # The lease A renewed last runs out at most one TTL after the kill.
    assert took <= TTL_S + PASS_S + 0.5, took
    row = await b.cluster(cluster.id)
    assert row.status == "waiting_for_nodes"  # B went on with it
    assert b.layer.calls_to("ensure_control_plane") == [cluster.name]


async def test_without_the_heartbeat_the_other_replica_claims_a_running_step(
    b: ControllerHarness, tmp_path: Path
) -> None:
    cluster = await b.rows.cluster(status="waiting_for_control_plane")
    a = start_a(b, tmp_path, cluster.id, 3 * TTL_S, "--no-heartbeat")
    try:
        await wait_for_a(b, cluster.id, a)
        got = await claims_during(b, cluster.id, 3 * TTL_S - 0.5)
    finally:
        a.kill()
        a.wait()
    assert got, "without a heartbeat the lease should have run out under the step"
    assert b.layer.calls_to("ensure_control_plane") == [cluster.name]  # run twice
