"""The in-process API under test (``tests/conftest.py``'s ``api`` fixture):
the app with its runtime and an httpx client on it, and the settings tests
start it with. Kept here, not in a conftest, so test modules import it by
one name whichever conftest pytest loaded first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from gpuclusters.server.runtime import Runtime
from gpuclusters.server.settings import Settings


@dataclass
class ApiHarness:
    client: httpx.AsyncClient
    settings: Settings
    admin_key: str
    app: FastAPI

    @property
    def runtime(self) -> Runtime:
        rt: Runtime = self.app.state.runtime
        return rt

    def as_key(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=self.client._transport,
            base_url=str(self.client.base_url),
            headers={"Authorization": f"Bearer {key}"},
        )

    async def wait_cluster(
        self, name: str, statuses: set[str], *, project: str = "default", within_s: float = 20
    ) -> dict[str, Any]:
        """Poll until the cluster reaches one of ``statuses`` (or 404 if
        ``"gone"`` is among them)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        last: dict[str, Any] = {}
        while loop.time() < deadline:
            r = await self.client.get(f"/v1/projects/{project}/clusters/{name}")
            if r.status_code == 404 and "gone" in statuses:
                return {}
            r.raise_for_status()
            last = r.json()
            if last["status"] in statuses:
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"cluster {name} did not reach {statuses}; last: {last}")


def make_settings(home: Path, database_url: str | None, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "home": home,
        "database_url": database_url,
        "provider": "fake",
        "fake_boot_delay_s": 0.05,
        "reconcile_interval_s": 0.2,
        "housekeeping_interval_s": 0.5,
        "acceptance_checks": [],  # acceptance tests are off in tests
    }
    values.update(overrides)
    return Settings(**values)
