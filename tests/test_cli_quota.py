"""``gpuclusters projects quota`` and a create beyond a quota, with the real
CLI against a real server process (fake provider)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_login import TlsServer, describe, gpuclusters, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    handle = start_server(tmp_path_factory.mktemp("quota-server"))
    try:
        yield handle
    finally:
        handle.stop()


def test_a_create_beyond_the_gpu_quota_is_refused_with_the_quota_named(
    server: TlsServer, tmp_path: Path
) -> None:
    admin = server.home  # the operator's CLI: its config has the admin key
    shown = gpuclusters(admin, "projects", "quota", "get", "--output", "json")
    assert shown.returncode == 0, describe(shown)
    assert json.loads(shown.stdout)["limits"]["standard_gpus"] is None
    r = gpuclusters(admin, "projects", "quota", "set", "--standard-gpus", "8", "--clusters", "3")
    assert r.returncode == 0, describe(r)
    assert "standard_gpus" in r.stdout and "8" in r.stdout
    refused = gpuclusters(admin, "clusters", "create", "big", "--type", "slurm", "--gpus", "16")
    assert refused.returncode == 1, describe(refused)
    assert "error [quota_exceeded]" in refused.stderr and "standard_gpus" in refused.stderr
    assert "may hold 8 standard GPUs" in refused.stderr
    listed = gpuclusters(admin, "clusters", "list", "--output", "json")
    assert json.loads(listed.stdout) == []
    # Only the quota given changes; none removes a limit.
    r = gpuclusters(admin, "projects", "quota", "set", "--standard-gpus", "none", "-o", "json")
    limits = json.loads(r.stdout)["limits"]
    assert limits["standard_gpus"] is None and limits["clusters"] == 3
    bad = gpuclusters(admin, "projects", "quota", "set", "--clusters", "-2")
    assert bad.returncode != 0 and "--clusters" in bad.stderr
