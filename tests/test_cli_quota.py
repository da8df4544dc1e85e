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


def test_budget_and_usage_reports(server: TlsServer) -> None:
    """``projects budget set|get|delete`` and ``usage --by ... --output csv``."""
    admin = server.home
    r = gpuclusters(admin, "projects", "budget", "set", "--monthly", "500", "--policy", "stop")
    assert r.returncode == 0, describe(r)
    assert "500.00 USD monthly" in r.stdout and "stop once spent" in r.stdout
    shown = json.loads(gpuclusters(admin, "projects", "budget", "get", "-o", "json").stdout)
    assert shown["budget"]["kind"] == "monthly" and shown["enforced"] is None
    both = gpuclusters(admin, "projects", "budget", "set", "--monthly", "5", "--credit", "5")
    assert both.returncode != 0 and "--monthly" in both.stderr
    bad = gpuclusters(admin, "projects", "budget", "set", "--credit", "5", "--policy", "nuke")
    assert bad.returncode != 0 and "policy" in bad.stderr
    r = gpuclusters(admin, "projects", "budget", "delete", "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["budget"] is None, describe(r)

    made = gpuclusters(
        admin, "clusters", "create", "u1", "--type", "slurm", "--gpus", "8", "--wait"
    )
    assert made.returncode == 0, describe(made)
    csv_out = gpuclusters(admin, "usage", "--by", "cluster", "--from", "1d", "--output", "csv")
    assert csv_out.returncode == 0, describe(csv_out)
    lines = csv_out.stdout.splitlines()
    assert lines[0] == "cluster,gpu_hours,cost,currency"
    assert lines[1].startswith("u1,") and lines[1].endswith(",USD")
    by_user = json.loads(gpuclusters(admin, "usage", "--by", "user", "-o", "json").stdout)
    assert [g["key"] for g in by_user["groups"]] == ["admin"]
    plain = gpuclusters(admin, "usage", "--output", "csv").stdout.splitlines()
    assert plain[0].startswith("cluster,class,billing,gpu_type")
