"""One replica's controller in a process of its own, for the lease tests
(tests/e2e/test_lease_heartbeat.py): on the database at URL it works on
cluster ROW_ID, whose control-plane step blocks for BLOCK_S seconds, then
prints ``done`` and exits. ``--no-heartbeat`` runs it with the lease
heartbeat turned off (the engine before it), to show the test fails then.

    python lease_replica.py URL HOME ROW_ID BLOCK_S TTL_S [--no-heartbeat]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from gpuclusters.server.controllers.base import Reconciler
from gpuclusters.server.controllers.testing import ControllerHarness


async def no_heartbeat(*args: object) -> None:
    await asyncio.Event().wait()


async def main(url: str, home: str, row_id: str, block_s: float, ttl_s: float) -> None:
    async with ControllerHarness.open(
        Path(home), database_url=url, owner="replica-a", lease_ttl_s=ttl_s
    ) as h:
        h.layer.script("ensure_control_plane", lambda: asyncio.sleep(block_s, True))
        claimed = await h.clusters.work_on(row_id)
        print("done" if claimed else "not claimed", flush=True)


if __name__ == "__main__":
    if "--no-heartbeat" in sys.argv:
        Reconciler._heartbeat = no_heartbeat  # type: ignore[method-assign,assignment]
    url, home, row_id, block_s, ttl_s = sys.argv[1:6]
    asyncio.run(main(url, home, row_id, float(block_s), float(ttl_s)))
