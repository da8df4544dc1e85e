"""Fixtures for end-to-end tests: real ``gpuclusters server`` subprocesses
(``support/servers.py``); every server a test started is stopped in
teardown, pass or fail.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import TEST_GATEWAY, TEST_GATEWAY_LINK, ServerHandle, Servers


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Servers]:
    """``server_factory(boot_delay_s=...)`` starts a server for this test."""
    servers = Servers(tmp_path)
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """One server shared by a whole test module (fast boots)."""
    servers = Servers(tmp_path_factory.mktemp("e2e-server"))
    try:
        yield servers(boot_delay_s=0.2)
    finally:
        servers.close()


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Servers that live as long as a test module (started by the module's
    own fixtures, with their settings)."""
    servers = Servers(tmp_path_factory.mktemp("e2e-servers"))
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="session", autouse=True)
def _remove_test_gateway() -> Iterator[None]:
    """The tests' gateway link goes with the session."""
    yield
    subprocess.run(
        ["ip", "addr", "del", f"{TEST_GATEWAY}/32", "dev", TEST_GATEWAY_LINK],
        capture_output=True,
        check=False,
    )
