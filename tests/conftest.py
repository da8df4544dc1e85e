"""Shared fixtures.

``api`` runs the real application in-process (lifespan, migrations,
reconcilers, fake provider) on a real database: SQLite in a temp home, and,
for tests parametrised with ``db_backend``, also a real PostgreSQL started
by ``support.postgres`` for the session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuclusters.core.clientconfig import read_config
from gpuclusters.server.app import create_app
from support.api import ApiHarness, make_settings
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
