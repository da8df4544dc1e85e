"""The ``gpuclusters`` CLI against canned HTTP answers.

The CLI's ``context.client_factory`` is replaced by one that builds a
:class:`Client` on an ``httpx.MockTransport``, so every command runs its real
code down to the HTTP request. stdout and stderr are checked separately: JSON
on stdout must parse and equal the model dump, errors and progress go to
stderr.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from gpuclusters.cli import context
from gpuclusters.cli.main import app
from gpuclusters.client import Client
from gpuclusters.core import kubeconfig
from gpuclusters.core.clientconfig import default_home
from gpuclusters.core.models import ApiKeyCreated, Cluster, ClusterCredentials
from support.cli import install_fake_api, isolate_env, ok, run
from support.fake_api import FakeApi, fake_kubeconfig

T0 = "2025-01-01T00:00:00Z"
BAD_GPUS = {
    "code": "invalid_input",
    "message": "num_gpus: must be a multiple of 8 (one node = 8 GPUs), got 12",
    "field": "num_gpus",
}


def node_json(name: str, phase: str = "running") -> dict[str, Any]:
    return {
        "name": name,
        "cluster": "train",
        "host": f"host-{name}",
        "compute_class": "standard",
        "phase": phase,
        "gpu_type": "H100_SXM",
        "created_at": T0,
    }


def cluster_json(
    status: str = "queued",
    *,
    phases: list[str] | None = None,
    nodes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "name": "train",
        "project": "default",
        "cluster_type": "slurm",
        "gpu_type": "H100_SXM",
        "region": "local-1",
        "num_gpus": 16,
        "num_preemptible_gpus": 8,
        "desired_preemptible_gpus": 8,
        "allocated_preemptible_gpus": 0,
        "billing_type": "on_demand",
        "status": status,
        "status_message": "acceptance tests failed" if status == "failed" else "",
        "phase_history": [
            {"phase": p, "timestamp": T0, "message": ""} for p in (phases or [status])
        ],
        "nodes": nodes or [],
        "created_at": T0,
        "updated_at": T0,
    }


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_env(monkeypatch, tmp_path)
    monkeypatch.setattr(context, "POLL_INTERVAL_S", 0.0)


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    return install_fake_api(monkeypatch)


# --- errors ------------------------------------------------------------------------------


def test_invalid_input_from_server_is_printed_with_code_and_field(api: FakeApi) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(BAD_GPUS, 422))

    result = run("clusters", "create", "bad", "--type", "slurm", "--gpus", "12")

    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip() == (
        "error [invalid_input]: num_gpus: must be a multiple of 8 (one node = 8 GPUs), "
        "got 12 (field: num_gpus)"
    )
    # The CLI does not pre-validate: the server saw the request as typed.
    assert json.loads(api.requests[0].content)["num_gpus"] == 12


def test_not_found_in_json_mode_keeps_stdout_empty(api: FakeApi) -> None:
    api.on(
        "GET",
        "/v1/projects/default/clusters/nope",
        ok({"code": "not_found", "message": "cluster nope not found", "field": None}, 404),
    )

    result = run("clusters", "get", "nope", "--output", "json")

    assert result.exit_code == 1
    assert result.stdout == ""
    assert "error [not_found]: cluster nope not found" in result.stderr
    assert "field" not in result.stderr


def test_unreachable_server_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    monkeypatch.setattr(
        context,
        "client_factory",
        lambda project: Client(
            "http://down.test:8470", None, transport=httpx.MockTransport(refuse)
        ),
    )

    result = run("whoami")

    assert result.exit_code == 1
    assert "error [connection_failed]" in result.stderr
    assert "http://down.test:8470" in result.stderr


def test_scale_without_changes_is_a_usage_error(api: FakeApi) -> None:
    result = run("clusters", "scale", "train")

    assert result.exit_code == 2
    assert api.requests == []


# --- output --------------------------------------------------------------------------------


def test_json_output_is_exactly_the_api_objects(api: FakeApi) -> None:
    body = [cluster_json("ready", nodes=[node_json("train-0")])]
    api.on("GET", "/v1/projects/default/clusters", ok(body))

    result = run("clusters", "list", "--output", "json")

    assert result.exit_code == 0, result.output
    expected = [Cluster.model_validate(c).model_dump(mode="json") for c in body]
    assert json.loads(result.stdout) == expected


def test_table_output_lists_clusters(api: FakeApi) -> None:
    nodes = [node_json("train-0"), node_json("train-1", "booting")]
    api.on("GET", "/v1/projects/research/clusters", ok([cluster_json("ready", nodes=nodes)]))

    result = run("clusters", "list", "--project", "research")

    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "TYPE",
        "GPU_TYPE",
        "GPUS",
        "PREEMPTIBLE",
        "STATUS",
        "NODES",
        "AGE",
    ]
    assert row.split()[:7] == ["train", "slurm", "H100_SXM", "16", "0/8", "ready", "1/2"]


def test_empty_list_prints_note_on_stderr_only(api: FakeApi) -> None:
    api.on("GET", "/v1/projects/default/volumes", ok([]))

    table = run("volumes", "list")
    as_json = run("volumes", "list", "-o", "json")

    assert (table.stdout, table.exit_code) == ("", 0)
    assert "no volumes" in table.stderr
    assert json.loads(as_json.stdout) == []


def test_get_shows_detail_with_nodes_and_phases(api: FakeApi) -> None:
    cluster = cluster_json("ready", phases=["queued", "ready"], nodes=[node_json("train-0")])
    api.on("GET", "/v1/projects/default/clusters/train", ok(cluster))

    result = run("clusters", "get", "train")

    assert result.exit_code == 0, result.output
    for text in ("status", "ready", "1/1 nodes running", "Phases", "queued", "train-0"):
        assert text in result.stdout


def test_events_table(api: FakeApi) -> None:
    event = {
        "node": "train-0",
        "cluster": "train",
        "reason": "Preempted",
        "message": "host reclaimed",
        "timestamp": T0,
        "first_timestamp": T0,
        "count": 2,
    }
    api.on("GET", "/v1/projects/default/events", ok([event]))

    result = run("events", "--cluster", "train")

    assert result.exit_code == 0, result.output
    assert "TIME" in result.stdout and "REASON" in result.stdout
    assert "Preempted" in result.stdout and "host reclaimed (x2)" in result.stdout
    assert dict(api.requests[0].url.params) == {"cluster": "train", "limit": "1000"}


def test_api_key_is_printed_with_a_shown_once_warning(api: FakeApi) -> None:
    created = {
        "user": "alice",
        "project": "research",
        "role": "admin",
        "key": "gpc_abcdef123456",
        "key_prefix": "gpc_abc",
    }
    api.on("POST", "/v1/api-keys", ok(created, 201))

    table = run("api-keys", "create", "--user", "alice", "--project", "research", "--role", "admin")
    as_json = run("api-keys", "create", "--user", "alice", "--project", "research", "-o", "json")

    assert table.exit_code == 0, table.output
    assert "gpc_abcdef123456" in table.stdout
    assert "shown only once" in table.stderr
    assert json.loads(as_json.stdout) == ApiKeyCreated.model_validate(created).model_dump(
        mode="json"
    )
    assert json.loads(api.requests[0].content) == {
        "user": "alice",
        "project": "research",
        "role": "admin",
    }


# --- create / scale / delete ----------------------------------------------------------------


def test_create_maps_flags_to_the_request_body(api: FakeApi) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(cluster_json(), 201))

    result = run(
        "clusters",
        "create",
        "train",
        "--type",
        "kubernetes",
        "--gpus",
        "16",
        "--preemptible-gpus",
        "8",
        "--billing",
        "scheduled",
        "--reservation-start",
        "2025-02-01T00:00:00Z",
        "--reservation-end",
        "2025-02-03T00:00:00Z",
        "--volume-size-tib",
        "2",
        "--no-egress",
        "-o",
        "json",
    )

    assert result.exit_code == 0, result.output
    assert json.loads(api.requests[0].content) == {
        "egress": False,
        "name": "train",
        "cluster_type": "kubernetes",
        "gpu_type": "H100_SXM",
        "num_gpus": 16,
        "num_preemptible_gpus": 8,
        "billing_type": "scheduled_capacity",
        "reservation_start": "2025-02-01T00:00:00Z",
        "reservation_end": "2025-02-03T00:00:00Z",
        "volume_size_tib": 2,
    }
    assert json.loads(result.stdout)["name"] == "train"


def test_scale_patches_only_given_counts(api: FakeApi) -> None:
    api.on("PATCH", "/v1/projects/default/clusters/train", ok(cluster_json("ready")))

    result = run("clusters", "scale", "train", "--preemptible-gpus", "16")

    assert result.exit_code == 0, result.output
    assert json.loads(api.requests[0].content) == {"num_preemptible_gpus": 16}


def test_create_wait_streams_progress_to_stderr_and_json_to_stdout(api: FakeApi) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(cluster_json("queued"), 201))
    final = cluster_json(
        "ready",
        phases=["queued", "waiting_for_nodes", "ready"],
        nodes=[node_json("train-0"), node_json("train-1")],
    )
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json("waiting_for_nodes", phases=["queued", "waiting_for_nodes"])),
        ok(
            cluster_json(
                "waiting_for_nodes",
                phases=["queued", "waiting_for_nodes"],
                nodes=[node_json("train-0"), node_json("train-1", "booting")],
            )
        ),
        ok(final),
    )

    result = run(
        "clusters", "create", "train", "--type", "slurm", "--gpus", "16", "--wait", "-o", "json"
    )

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == Cluster.model_validate(final).model_dump(mode="json")
    err = result.stderr
    positions = [err.index(p) for p in ("queued", "waiting_for_nodes", "  ready")]
    assert positions == sorted(positions)
    assert err.count("waiting_for_nodes") == 1  # each transition is shown once
    assert "1/2 nodes running (1 booting)" in err
    assert "2/2 nodes running" in err


def test_create_wait_exits_nonzero_when_cluster_fails(api: FakeApi) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(cluster_json("queued"), 201))
    api.on("GET", "/v1/projects/default/clusters/train", ok(cluster_json("failed")))

    result = run(
        "clusters", "create", "train", "--type", "slurm", "--gpus", "16", "--wait", "-o", "json"
    )

    assert result.exit_code == 1
    assert result.stdout == ""
    assert "error [cluster_failed]: cluster train failed: acceptance tests failed" in result.stderr


def test_delete_wait_returns_when_cluster_is_gone(api: FakeApi) -> None:
    deleting = cluster_json("deleting", phases=["queued", "ready", "deleting"])
    api.on("DELETE", "/v1/projects/default/clusters/train", ok(deleting, 202))
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json("deleting", nodes=[node_json("train-0", "draining")])),
        ok({"code": "not_found", "message": "cluster train not found", "field": None}, 404),
    )

    result = run("clusters", "delete", "train", "--delete-volume", "--wait", "--yes", "-o", "json")

    assert result.exit_code == 0, result.output
    assert dict(api.requests[0].url.params) == {"delete_volume": "true"}
    assert json.loads(result.stdout)["status"] == "deleting"  # last state the API reported
    assert "0/1 nodes running (1 draining)" in result.stderr
    assert "cluster train is deleted" in result.stderr
    assert "queued" not in result.stderr  # the create is not replayed


def test_forced_delete_sends_the_reason_and_wait_says_why_steps_fail(api: FakeApi) -> None:
    deleting = cluster_json("deleting", phases=["ready", "deleting"])
    api.on("DELETE", "/v1/projects/default/clusters/train", ok(deleting, 202))
    stuck = node_json("train-0", "releasing") | {
        "retries": 3,
        "last_error": "deleting the instance: no route to host",
        "next_attempt_at": T0,
    }
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json("deleting", nodes=[stuck])),
        ok(cluster_json("deleting", nodes=[stuck | {"retries": 4}])),
        ok({"code": "not_found", "message": "cluster train not found", "field": None}, 404),
    )

    result = run(
        "clusters", "delete", "train", "--force", "--reason", "host lost", "--wait", "--yes"
    )

    assert result.exit_code == 0, result.output
    assert dict(api.requests[0].url.params) == {"force": "true", "reason": "host lost"}
    # A failing step is said once (not at every poll), with its count.
    assert result.stderr.count("deleting the instance: no route to host") == 1
    assert "train-0: attempt 3 failed" in result.stderr


def test_a_reason_without_force_is_a_usage_error(api: FakeApi) -> None:
    result = run("clusters", "delete", "train", "--reason", "why")
    assert result.exit_code == 2
    assert "--reason goes with --force" in result.output
    assert api.requests == []


def test_node_get_shows_retries_last_error_next_attempt_and_deadline(api: FakeApi) -> None:
    node = node_json("train-0", "booting") | {
        "retries": 2,
        "last_error": "volume v has no data directory yet",
        "next_attempt_at": T0,
        "phase_deadline_at": T0,
    }
    api.on("GET", "/v1/projects/default/nodes/train-0", ok(node))

    result = run("nodes", "get", "train-0")

    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "retries 2" in out
    assert "last error volume v has no data directory yet" in out
    assert "next attempt 20" in out and "deadline 20" in out  # the times, with how long ago


# --- wiring --------------------------------------------------------------------------------


def test_server_command_calls_server_run_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("gpuclusters.server.main")
    fake.run = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gpuclusters.server.main", fake)

    result = CliRunner().invoke(
        app, ["server", "--provider", "netns"], env={"GPUCLUSTERS_PORT": "9000"}
    )

    assert result.exit_code == 0, result.output
    assert calls == [{"host": None, "port": 9000, "provider": "netns"}]


def test_default_factory_uses_config_file_and_project_flag(tmp_path: Path) -> None:
    from gpuclusters.core.clientconfig import write_config

    write_config(tmp_path / "home", url="http://cfg.test:1", api_key="k", project="p")

    with context._default_client_factory("other") as client:
        assert (client.url, client.project) == ("http://cfg.test:1", "other")


def test_cli_import_does_not_load_the_server() -> None:
    code = (
        "import sys, gpuclusters.cli.main; "
        "bad = [m for m in sys.modules if m.split('.')[:2] in "
        "(['gpuclusters','server'], ['gpuclusters','providers'], ['gpuclusters','layers'])]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ssh_as_root_execs_the_command_line_the_server_gives(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's path; the default (SSH with a certificate) is in test_cli_ssh.py.
    target = {"cluster": "train", "node": "n1", "user": "root", "argv": ["true", "x"]}
    api.on("POST", "/v1/projects/default/clusters/train/ssh", ok(target))
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr("os.execvp", lambda f, argv: execs.append((f, list(argv))))
    result = run("clusters", "ssh", "train", "--as-root", "--node", "n1", "--", "sinfo", "-N")
    assert result.exit_code == 0, result.output
    assert execs == [("true", ["true", "x"])]
    sent = api.requests[-1]
    assert sent.url.params["node"] == "n1"
    assert json.loads(sent.content) == {"command": ["sinfo", "-N"], "as_root": True}


def test_configure_sends_files_and_keeps_other_settings(api: FakeApi, tmp_path: Path) -> None:
    current = cluster_json("ready")
    current["slurm"] = {"extra_config": "KillWait=60", "prolog": None, "epilog": "#!/bin/sh\n"}
    api.on("GET", "/v1/projects/default/clusters/train", ok(current))
    api.on("PATCH", "/v1/projects/default/clusters/train", ok(current))
    prolog = tmp_path / "prolog.sh"
    prolog.write_text("#!/bin/bash\nexit 0\n")
    result = run("clusters", "configure", "train", "--prolog", str(prolog))
    assert result.exit_code == 0, result.output
    body = json.loads(api.requests[-1].content)
    assert body == {
        "slurm": {
            "extra_config": "KillWait=60",
            "prolog": "#!/bin/bash\nexit 0\n",
            "epilog": "#!/bin/sh\n",
        }
    }


# --- clusters credentials ----------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_credentials_to_stdout_prints_the_kubeconfig(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")

    result = run("clusters", "credentials", "train", "--file", "-")

    assert result.exit_code == 0, result.output
    config = kubeconfig.load(result.stdout)
    assert config["current-context"] == "train"
    assert [u["name"] for u in config["users"]] == ["alice@train"]
    assert result.stderr == ""


def test_credentials_to_a_new_file_is_private_and_current(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")
    path = tmp_path / "new" / "dir" / "train.kubeconfig"

    result = run("clusters", "credentials", "train", "--file", str(path))

    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f'wrote context "train" to {path} (use: kubectl --kubeconfig {path} get nodes)\n'
    )
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    config = kubeconfig.load(path.read_text())
    assert config["current-context"] == "train"
    assert json.loads(api.requests[0].content) == {"context_name": None}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def _file_with_other_cluster(path: Path) -> dict[str, Any]:
    other = kubeconfig.load(fake_kubeconfig("other", user="alice"))
    path.write_text(kubeconfig.dump(other))
    path.chmod(0o644)
    return other


def test_credentials_merge_keeps_other_contexts_and_current(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")
    path = tmp_path / "config"
    other = _file_with_other_cluster(path)

    result = run("clusters", "credentials", "train", "--file", str(path))

    assert result.exit_code == 0, result.output
    assert f"kubectl --kubeconfig {path} --context train get nodes" in result.stdout
    merged = kubeconfig.load(path.read_text())
    assert [c["name"] for c in merged["contexts"]] == ["other", "train"]
    assert merged["clusters"][0] == other["clusters"][0]
    assert merged["users"][0] == other["users"][0]
    assert merged["current-context"] == "other"
    assert _mode(path) == 0o600


def test_credentials_set_default_context_and_context_name(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")
    path = tmp_path / "config"
    _file_with_other_cluster(path)

    result = run(
        "clusters",
        "credentials",
        "train",
        "--file",
        str(path),
        "--context-name",
        "lab-train",
        "--set-default-context",
    )

    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f'wrote context "lab-train" to {path} ')
    assert json.loads(api.requests[0].content) == {"context_name": "lab-train"}
    merged = kubeconfig.load(path.read_text())
    assert merged["current-context"] == "lab-train"
    assert [c["name"] for c in merged["clusters"]] == ["other", "lab-train"]
    assert [u["name"] for u in merged["users"]] == ["alice@other", "alice@lab-train"]


def test_credentials_again_replaces_only_its_own_entries(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")
    path = tmp_path / "config"
    _file_with_other_cluster(path)
    assert run("clusters", "credentials", "train", "--file", str(path)).exit_code == 0
    first = path.read_text()

    assert run("clusters", "credentials", "train", "--file", str(path)).exit_code == 0

    assert path.read_text() == first


@pytest.mark.parametrize(
    "content", ["clusters: [unclosed\n", "- just\n- a list\n", "kind: Pod\nmetadata: {}\n"]
)
def test_credentials_refuse_a_file_that_is_not_a_kubeconfig(
    api: FakeApi, tmp_path: Path, content: str
) -> None:
    api.serve_credentials("train")
    path = tmp_path / "config"
    path.write_text(content)
    path.chmod(0o644)

    result = run("clusters", "credentials", "train", "--file", str(path))

    assert result.exit_code == 1
    assert result.stdout == ""
    assert f"{path} is not a valid kubeconfig" in result.stderr
    assert "left unchanged" in result.stderr
    assert path.read_text() == content and _mode(path) == 0o644
    assert api.requests == []  # nothing was issued


def test_credentials_default_to_first_kubeconfig_path_then_home(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.serve_credentials("train")
    first, second = tmp_path / "a" / "config", tmp_path / "b" / "config"
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{second}")

    result = run("clusters", "credentials", "train")

    assert result.exit_code == 0, result.output
    assert result.stdout == f'wrote context "train" to {first} (use: kubectl get nodes)\n'
    assert first.exists() and not second.exists()

    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path / "home-dir"))
    result = run("clusters", "credentials", "train")
    assert result.exit_code == 0, result.output
    default = tmp_path / "home-dir" / ".kube" / "config"
    assert kubeconfig.load(default.read_text())["current-context"] == "train"
    assert _mode(default.parent) == 0o700


def test_credentials_json_output_is_the_api_object(api: FakeApi, tmp_path: Path) -> None:
    api.serve_credentials("train")
    path = tmp_path / "config"

    result = run("clusters", "credentials", "train", "--file", str(path), "--output", "json")

    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body == ClusterCredentials.model_validate(body).model_dump(mode="json")
    assert (body["cluster"], body["context"], body["user"]) == ("train", "train", "alice")
    assert kubeconfig.load(body["kubeconfig"])["current-context"] == "train"
    assert f'wrote context "train" to {path}' in result.stderr
    assert path.exists()


def test_credentials_error_from_server_writes_nothing(api: FakeApi, tmp_path: Path) -> None:
    api.on(
        "POST",
        "/v1/projects/default/clusters/train/credentials",
        ok({"code": "invalid_state", "message": "cluster train is queued, not ready"}, 409),
    )
    path = tmp_path / "config"

    result = run("clusters", "credentials", "train", "--file", str(path))

    assert result.exit_code == 1
    assert "error [invalid_state]: cluster train is queued, not ready" in result.stderr
    assert not path.exists()


# --- capacity, preemption, usage -----------------------------------------------------------


def test_create_queue_and_start_at_reach_the_request(api: FakeApi) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(cluster_json(), 201))

    result = run(
        "clusters",
        "create",
        "train",
        "--type",
        "slurm",
        "--gpus",
        "8",
        "--queue",
        "--start-at",
        "2030-01-01T00:00:00Z",
        "-o",
        "json",
    )

    assert result.exit_code == 0, result.output
    body = json.loads(api.requests[0].content)
    assert body["queue_if_unavailable"] is True and body["start_at"] == "2030-01-01T00:00:00Z"


def host_json(state: str = "cordoned") -> dict[str, Any]:
    return {
        "name": "h100-a-01",
        "region": "local-1",
        "gpu_type": "H100_SXM",
        "num_gpus": 8,
        "nvme_gib": 7680,
        "ib_island": "ib-a",
        "state": state,
        "node": "p1-preemptible-abcde",
        "cluster": "p1",
        "compute_class": "preemptible",
        "node_phase": "draining",
    }


def test_hosts_reclaim_and_uncordon(api: FakeApi) -> None:
    api.on("POST", "/v1/hosts/h100-a-01/reclaim", ok(host_json()))
    api.on("POST", "/v1/hosts/h100-a-01/uncordon", ok(host_json("available")))

    reclaimed = run("hosts", "reclaim", "h100-a-01")
    assert reclaimed.exit_code == 0, reclaimed.output
    assert "cordoned" in reclaimed.stdout and "preemptible" in reclaimed.stdout
    back = run("hosts", "uncordon", "h100-a-01", "-o", "json")
    assert back.exit_code == 0 and json.loads(back.stdout)["state"] == "available"
    assert [r.url.path for r in api.requests] == [
        "/v1/hosts/h100-a-01/reclaim",
        "/v1/hosts/h100-a-01/uncordon",
    ]


def test_hosts_list_pages_and_get_reads_one_host(api: FakeApi) -> None:
    second = {**host_json("available"), "name": "h100-a-02", "node": None, "cluster": None}
    api.on(
        "GET",
        "/v1/hosts",
        httpx.Response(200, json=[host_json()], headers={"X-Next-Cursor": "c1"}),
        ok([second]),
        httpx.Response(200, json=[host_json()], headers={"X-Next-Cursor": "c1"}),
    )
    api.on("GET", "/v1/hosts/h100-a-02", ok(second))

    every = run("hosts", "list", "-o", "json")
    assert every.exit_code == 0, every.output
    assert [h["name"] for h in json.loads(every.stdout)] == ["h100-a-01", "h100-a-02"]
    one = run("hosts", "list", "--limit", "1")
    assert one.exit_code == 0, one.output
    assert "h100-a-01" in one.stdout and "h100-a-02" not in one.stdout
    assert "more: --cursor c1" in one.stderr
    got = run("hosts", "get", "h100-a-02", "-o", "json")
    assert got.exit_code == 0 and json.loads(got.stdout)["name"] == "h100-a-02", got.output
    assert [dict(r.url.params) for r in api.requests] == [
        {"limit": "1000"},
        {"limit": "1000", "cursor": "c1"},
        {"limit": "1"},
        {},
    ]


def test_hosts_reclaim_of_a_standard_host_is_refused_clearly(api: FakeApi) -> None:
    refusal = {
        "code": "invalid_state",
        "message": "host h100-a-01 runs standard node x; only hosts of preemptible nodes "
        "can be reclaimed",
        "field": "name",
    }
    api.on("POST", "/v1/hosts/h100-a-01/reclaim", ok(refusal, 409))
    result = run("hosts", "reclaim", "h100-a-01")
    assert result.exit_code != 0
    assert "invalid_state" in result.stderr and "standard node" in result.stderr


def usage_json() -> dict[str, Any]:
    line = {
        "cluster": "p1",
        "compute_class": "preemptible",
        "billing": "preemptible",
        "gpu_type": "H100_SXM",
        "nodes": 2,
        "node_hours": 1.5,
        "gpu_hours": 12.0,
        "rate_per_gpu_hour": 1.196,
        "cost": 14.352,
    }
    return {
        "project": "default",
        "since": T0,
        "until": "2025-01-02T00:00:00Z",
        "currency": "USD",
        "lines": [line],
        "total_gpu_hours": 12.0,
        "total_cost": 14.352,
    }


def test_usage_table_json_and_time_arguments(api: FakeApi) -> None:
    api.on("GET", "/v1/projects/default/usage", ok(usage_json()))

    table = run("usage", "--since", "2025-01-01", "--until", "2025-01-02T00:00:00Z")
    assert table.exit_code == 0, table.output
    assert "preemptible" in table.stdout and "14.35 USD" in table.stdout
    assert dict(api.requests[0].url.params) == {
        "since": "2025-01-01T00:00:00+00:00",
        "until": "2025-01-02T00:00:00+00:00",
    }
    as_json = run("usage", "--since", "7d", "-o", "json")
    assert as_json.exit_code == 0, as_json.output
    printed = json.loads(as_json.stdout)
    assert printed["lines"] == usage_json()["lines"] and printed["total_cost"] == 14.352
    since = datetime.fromisoformat(api.requests[1].url.params["since"])
    assert abs((datetime.now(UTC) - since) - timedelta(days=7)) < timedelta(minutes=1)
    bad = run("usage", "--since", "yesterday")
    assert bad.exit_code == 2 and "--since" in bad.output


def test_capacity_create_sends_windows_and_lists(api: FakeApi) -> None:
    capacity = {
        "name": "pool-a",
        "project": "research",
        "kind": "pool",
        "gpu_type": "H100_SXM",
        "region": "local-1",
        "num_gpus": 16,
        "windows": [
            {"start": "2030-01-01T00:00:00Z", "end": "2030-01-02T00:00:00Z", "active": False},
            {"start": "2030-01-05T00:00:00Z", "end": "2030-01-06T00:00:00Z", "active": False},
        ],
        "created_at": T0,
    }
    api.on("POST", "/v1/capacity", ok(capacity, 201))
    api.on("GET", "/v1/capacity", ok([capacity]))
    api.on("DELETE", "/v1/capacity/pool-a", httpx.Response(204))

    created = run(
        "capacity",
        "create",
        "pool-a",
        "--project",
        "research",
        "--kind",
        "pool",
        "--gpus",
        "16",
        "--window",
        "2030-01-01T00:00Z/2030-01-02T00:00Z",
        "--window",
        "2030-01-05/2030-01-06",
    )
    assert created.exit_code == 0, created.output
    body = json.loads(api.requests[0].content)
    assert body["kind"] == "pool" and body["num_gpus"] == 16
    assert body["windows"] == [
        {"start": "2030-01-01T00:00:00+00:00", "end": "2030-01-02T00:00:00+00:00"},
        {"start": "2030-01-05T00:00:00+00:00", "end": "2030-01-06T00:00:00+00:00"},
    ]
    listed = run("capacity", "list", "-o", "json")
    assert [c["name"] for c in json.loads(listed.stdout)] == ["pool-a"]
    deleted = run("capacity", "delete", "pool-a")
    assert deleted.exit_code == 0 and "deleted" in deleted.stdout
    bad = run("capacity", "create", "x", "--project", "p", "--gpus", "8", "--window", "2030-01-01")
    assert bad.exit_code == 2 and "START/END" in bad.output


# --- health and repair -----------------------------------------------------------------------


def alert_json() -> dict[str, Any]:
    return {
        "id": "a1",
        "cluster": "train",
        "node": "train-0",
        "kind": "gpu_missing",
        "severity": "critical",
        "gpu": 3,
        "code": 79,
        "subject": None,
        "message": "GPU 3: Xid 79 (fallen off the bus) (fatal)",
        "started_at": T0,
        "last_seen_at": T0,
        "resolved_at": None,
    }


def repair_json(state: str = "pending_approval") -> dict[str, Any]:
    return {
        "id": "r1",
        "cluster": "train",
        "node": "train-0",
        "action": "migrate",
        "state": state,
        "step": None,
        "trigger": "automated",
        "reason": "GPU 3: Xid 79",
        "message": "",
        "requested_by": "gpuclusters",
        "reviewed_by": "admin" if state != "pending_approval" else None,
        "idempotency_key": "auto:n:x:migrate",
        "alert_ids": ["a1"],
        "health_run_ids": [],
        "created_at": T0,
        "updated_at": T0,
    }


def test_alerts_and_repairs_review(api: FakeApi) -> None:
    api.on("GET", "/v1/projects/default/alerts", ok([alert_json()]))
    api.on("GET", "/v1/projects/default/repairs", ok([repair_json()]))
    api.on("POST", "/v1/projects/default/repairs/r1/approve", ok(repair_json("pending")))

    alerts = run("alerts", "list")
    assert alerts.exit_code == 0, alerts.output
    assert "critical" in alerts.stdout and "gpu_missing" in alerts.stdout
    assert json.loads(run("alerts", "list", "-o", "json").stdout) == [alert_json()]
    listed = run("repairs", "list", "--cluster", "train")
    assert "pending_approval" in listed.stdout and "migrate" in listed.stdout
    assert dict(api.requests[-1].url.params) == {"cluster": "train"}
    approved = run("repairs", "approve", "r1", "-o", "json")
    assert approved.exit_code == 0 and json.loads(approved.stdout)["state"] == "pending"


def test_health_run_waits_for_results(api: FakeApi) -> None:
    queued = {
        "id": "h1",
        "cluster": "train",
        "node": "train-0",
        "check": "gpu-burn",
        "state": "pending",
        "duration_s": 5.0,
        "created_at": T0,
    }
    api.on("POST", "/v1/projects/default/clusters/train/health-checks", ok([queued], 201))
    api.on(
        "GET",
        "/v1/projects/default/health-checks/h1",
        ok(queued | {"state": "running"}),
        ok(queued | {"state": "skipped", "reason": "no GPU"}),
    )
    result = run("health", "run", "train", "--check", "gpu-burn", "--duration", "5", "-o", "json")
    assert result.exit_code == 0, result.output
    (h,) = json.loads(result.stdout)
    assert (h["state"], h["reason"]) == ("skipped", "no GPU")
    assert json.loads(api.requests[0].content) == {
        "check": "gpu-burn",
        "node": None,
        "duration_s": 5.0,
    }


def test_inject_fault_auto_repair_and_repair_policy(api: FakeApi) -> None:
    node = node_json("train-0") | {"gpu_backend": "simulated"}
    api.on("POST", "/v1/projects/default/nodes/train-0/faults", ok(node))
    api.on("PATCH", "/v1/projects/default/nodes/train-0", ok(node | {"auto_repair": False}))
    api.on("GET", "/v1/projects/default/clusters/train", ok(cluster_json("ready")))
    api.on("PATCH", "/v1/projects/default/clusters/train", ok(cluster_json("ready")))

    r = run("nodes", "inject-fault", "train-0", "--kind", "xid", "--code", "79", "--gpu", "3")
    assert r.exit_code == 0, r.output
    assert json.loads(api.requests[0].content) == {"kind": "xid", "code": 79, "gpu": 3}
    r = run("nodes", "inject-fault", "train-0", "--kind", "clear")
    assert r.exit_code == 0 and api.requests[1].content in (b"", b"null")
    r = run("nodes", "auto-repair", "train-0", "off")
    assert r.exit_code == 0 and json.loads(api.requests[2].content) == {"auto_repair": False}
    assert run("nodes", "auto-repair", "train-0", "maybe").exit_code == 2
    r = run(
        "clusters",
        "configure",
        "train",
        "--repair-automatic",
        "ecc_dbe, xid",
        "--repair-max-wait",
        "0",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(api.requests[-1].content) == {
        "repair": {"automatic": ["ecc_dbe", "xid"], "max_wait_s": 0}
    }


def test_up_serves_the_api_over_tls_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`gpuclusters up` turns TLS on (the image registry the README's
    examples pull from needs it); GPUCLUSTERS_TLS, when set, decides."""
    from gpuclusters.cli import server as server_cli

    calls: list[dict[str, Any]] = []
    fake = types.SimpleNamespace(run=lambda **kw: calls.append(kw))
    monkeypatch.setattr(server_cli.importlib, "import_module", lambda name: fake)
    monkeypatch.setattr(server_cli.os, "geteuid", lambda: 0)
    monkeypatch.delenv("GPUCLUSTERS_TLS", raising=False)
    runner = CliRunner()
    assert runner.invoke(app, ["up"]).exit_code == 0
    assert calls[-1]["tls_mode"] == "on" and calls[-1]["provider"] == "netns"
    monkeypatch.setenv("GPUCLUSTERS_TLS", "auto")
    assert runner.invoke(app, ["up"]).exit_code == 0
    assert "tls_mode" not in calls[-1]  # the server reads the variable itself
    # `server` leaves TLS to the settings (auto: on with a public host).
    monkeypatch.delenv("GPUCLUSTERS_TLS")
    assert runner.invoke(app, ["server"]).exit_code == 0
    assert "tls_mode" not in calls[-1]


def test_token_prints_an_exec_credential_and_refuses_another_users(api: FakeApi) -> None:
    path = "/v1/projects/default/clusters/train/token"
    api.on(
        "POST",
        path,
        httpx.Response(
            200,
            json={"cluster": "train", "user": "alice", "token": "jwt.a.b",
                  "expires_at": "2026-12-07T10:05:00Z"},
        ),
    )  # fmt: skip
    result = run("clusters", "token", "train", "--user", "alice")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": "jwt.a.b", "expirationTimestamp": "2026-12-07T10:05:00Z"},
    }
    refused = run("clusters", "token", "train", "--user", "bob")
    assert refused.exit_code == 1 and refused.stdout == ""
    assert "this kubeconfig is bob's, but the CLI is logged in as alice" in refused.stderr


def test_credentials_point_the_exec_plugin_at_this_cli(api: FakeApi, tmp_path: Path) -> None:
    exec_config = kubeconfig.dump(
        kubeconfig.render(
            cluster_name="train",
            server="https://train.test:6443",
            ca_pem=b"ca",
            user_name="alice",
            exec_credential=kubeconfig.exec_user(project="default", cluster="train", user="alice"),
        )
    )
    api.on(
        "POST",
        "/v1/projects/default/clusters/train/credentials",
        httpx.Response(
            200,
            json={"cluster": "train", "context": "train", "user": "alice",
                  "kubeconfig": exec_config},
        ),
    )  # fmt: skip
    path = tmp_path / "kc"
    assert run("clusters", "credentials", "train", "--file", str(path)).exit_code == 0
    (user,) = yaml.safe_load(path.read_text())["users"]
    exe = user["user"]["exec"]
    assert Path(exe["command"]).is_absolute() or exe["command"] == "gpuclusters"
    assert exe["env"] == [{"name": "GPUCLUSTERS_HOME", "value": str(default_home().resolve())}]
    assert exe["args"] == ["clusters", "token", "train", "--project", "default", "--user", "alice"]
