"""The issue's acceptance steps, run through the real ``gpuclusters`` CLI
against a real server process (one server for the whole module).

The CLI reads the server's URL and the bootstrap admin key from
``$GPUCLUSTERS_HOME/config.toml``; a second user's key is passed with
``GPUCLUSTERS_API_KEY``.
"""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # fixtures' types; the classes live in this directory's conftest
    from support.servers import ServerHandle

pytestmark = pytest.mark.slow


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"gpuclusters {' '.join(result.args[1:])} -> {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    """The parsed stdout of a command that must have succeeded."""
    assert result.returncode == 0, describe(result)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not JSON:\n{describe(result)}")


def refused(result: subprocess.CompletedProcess[str], code: str) -> str:
    """The stderr of a command that must have failed with ``error [code]``."""
    assert result.returncode != 0, describe(result)
    assert f"[{code}]" in result.stderr, describe(result)
    assert result.stdout == "", describe(result)
    return result.stderr


def names(items: list[dict[str, Any]]) -> set[str]:
    return {item["name"] for item in items}


@pytest.fixture(scope="module")
def server(module_server: ServerHandle) -> ServerHandle:
    return module_server


@pytest.fixture(scope="module")
def demo2(server: ServerHandle) -> dict[str, Any]:
    """A ready one-node cluster in the default project."""
    cluster = ok_json(
        server.cli(
            "clusters",
            "create",
            "demo2",
            "--type",
            "slurm",
            "--gpus",
            "8",
            "--wait",
            "--output",
            "json",
        )
    )
    assert cluster["status"] == "ready", cluster
    return dict(cluster)


@pytest.fixture(scope="module")
def bob_key(server: ServerHandle) -> str:
    """An admin key of project p2, whose user is no member of ``default``."""
    project = server.cli("projects", "create", "p2", "--output", "json")
    assert ok_json(project)["name"] == "p2"
    created = ok_json(
        server.cli(
            "api-keys",
            "create",
            "--user",
            "bob",
            "--project",
            "p2",
            "--role",
            "admin",
            "--output",
            "json",
        )
    )
    assert created["user"] == "bob"
    assert created["project"] == "p2"
    assert created["role"] == "admin"
    assert created["key"]
    return str(created["key"])


def test_create_wait_then_delete_keeps_the_volume(server: ServerHandle) -> None:
    cluster = ok_json(
        server.cli(
            "clusters",
            "create",
            "demo",
            "--type",
            "slurm",
            "--gpus",
            "16",
            "--wait",
            "--output",
            "json",
        )
    )
    assert cluster["name"] == "demo"
    assert cluster["status"] == "ready"
    assert cluster["num_gpus"] == 16
    assert cluster["volume"] == "demo-shared"
    assert len(cluster["nodes"]) == 2, cluster["nodes"]
    assert {n["phase"] for n in cluster["nodes"]} == {"running"}
    assert len({n["host"] for n in cluster["nodes"]}) == 2

    deleted = server.cli("clusters", "delete", "demo", "--wait")
    assert deleted.returncode == 0, describe(deleted)

    refused(server.cli("clusters", "get", "demo"), "not_found")
    assert "demo" not in names(ok_json(server.cli("clusters", "list", "--output", "json")))
    volumes = {v["name"]: v for v in ok_json(server.cli("volumes", "list", "--output", "json"))}
    assert "demo-shared" in volumes, volumes
    assert volumes["demo-shared"]["status"] == "available"
    assert volumes["demo-shared"]["cluster"] is None


def test_gpu_count_not_a_multiple_of_8_is_refused_without_side_effects(
    server: ServerHandle,
) -> None:
    stderr = refused(
        server.cli("clusters", "create", "bad", "--type", "slurm", "--gpus", "12"),
        "invalid_input",
    )
    assert "num_gpus" in stderr
    assert "12" in stderr
    assert "multiple of 8" in stderr

    assert "bad" not in names(ok_json(server.cli("clusters", "list", "--output", "json")))
    assert "bad-shared" not in names(ok_json(server.cli("volumes", "list", "--output", "json")))


def test_another_projects_admin_cannot_see_or_delete_clusters(
    server: ServerHandle, demo2: dict[str, Any], bob_key: str
) -> None:
    as_bob_in_default = {"GPUCLUSTERS_API_KEY": bob_key, "GPUCLUSTERS_PROJECT": "default"}
    refused(server.cli("clusters", "get", "demo2", env=as_bob_in_default), "not_found")
    refused(server.cli("clusters", "delete", "demo2", env=as_bob_in_default), "not_found")
    refused(server.cli("clusters", "list", env=as_bob_in_default), "not_found")

    as_bob_in_p2 = {"GPUCLUSTERS_API_KEY": bob_key, "GPUCLUSTERS_PROJECT": "p2"}
    assert ok_json(server.cli("clusters", "list", "--output", "json", env=as_bob_in_p2)) == []

    # Untouched, as the admin sees it.
    still = ok_json(server.cli("clusters", "get", "demo2", "--output", "json"))
    assert still["status"] == "ready", still
    assert [n["name"] for n in still["nodes"]] == [n["name"] for n in demo2["nodes"]]


def test_json_output_of_nodes_events_and_hosts(server: ServerHandle, demo2: dict[str, Any]) -> None:
    (node,) = demo2["nodes"]

    nodes = ok_json(server.cli("nodes", "list", "--output", "json"))
    assert isinstance(nodes, list)
    for n in nodes:
        assert {"name", "cluster", "host", "compute_class", "phase"} <= n.keys(), n
    mine = [n for n in nodes if n["name"] == node["name"]]
    assert len(mine) == 1, nodes
    assert mine[0]["cluster"] == "demo2"
    assert mine[0]["host"] == node["host"]
    assert mine[0]["compute_class"] == "standard"
    assert mine[0]["phase"] == "running"

    events = ok_json(server.cli("events", "--cluster", "demo2", "--output", "json"))
    assert isinstance(events, list)
    assert events, "a node that came up must have an event"
    for e in events:
        assert {"node", "reason", "message", "timestamp"} <= e.keys(), e
    assert {e["node"] for e in events} == {node["name"]}
    assert any(e["reason"] == "NodeAdded" for e in events), events

    hosts = ok_json(server.cli("hosts", "list", "--output", "json"))
    assert isinstance(hosts, list)
    by_name = {h["name"]: h for h in hosts}
    assert by_name[node["host"]]["node"] == node["name"]
    assert by_name[node["host"]]["cluster"] == "demo2"
    assert all((h["node"] is None) == (h["cluster"] is None) for h in hosts), hosts
