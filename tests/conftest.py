"""Shared fixtures.

``api`` runs the real application in-process (lifespan, migrations,
reconcilers, fake provider) on a real database: SQLite in a temp home, and,
for tests parametrised with ``db_backend``, also a real PostgreSQL started
by ``support.postgres`` for the session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gpuclusters.core.clientconfig import read_config
from gpuclusters.server.app import create_app
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.settings import Settings
from support.postgres import PostgresServer, postgres_server_fixture


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    yield from postgres_server_fixture()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_backend(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """A database URL: None means the default SQLite in the server's home."""
    if request.param == "sqlite":
        yield None
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with server.temporary_database() as url:
        yield url


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


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Override in a test module to change server settings."""
    return {}


@pytest.fixture
async def api(
    tmp_path: Path, db_backend: str | None, settings_overrides: dict[str, Any]
) -> AsyncIterator[ApiHarness]:
    settings = make_settings(tmp_path / "home", db_backend, **settings_overrides)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        key = read_config(settings.home).api_key
        assert key
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://testserver",
            headers={"Authorization": f"Bearer {key}"},
        ) as client:
            yield ApiHarness(client=client, settings=settings, admin_key=key, app=app)
