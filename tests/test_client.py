"""The typed client against canned HTTP answers (``httpx.MockTransport``).

Covers: request shape (paths, auth, query, bodies), error bodies becoming the
domain error classes, connection failures, response validation, ``wait``
semantics, and the config file (precedence and 0600 mode).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuclusters.client import (
    AlreadyExistsError,
    AuthenticationError,
    CapacityUnavailableError,
    Client,
    ClientConfig,
    ClientConfigError,
    ClusterFailedError,
    ConflictError,
    ConnectionFailedError,
    GpuClustersError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    ServerError,
    UnexpectedResponseError,
    ValidationError,
    WaitTimeoutError,
)
from gpuclusters.core import kubeconfig
from gpuclusters.core.clientconfig import read_config, write_config
from gpuclusters.core.enums import ClusterStatus, ClusterType, NodePhase
from gpuclusters.core.models import (
    Cluster,
    ClusterCreate,
    ClusterCredentials,
    ClusterUpdate,
    Node,
    WhoAmI,
)
from support.fake_api import FakeApi

URL = "http://api.test"
T0 = "2025-01-01T00:00:00Z"


def node_json(name: str, phase: str = "running", *, cluster: str = "train") -> dict[str, Any]:
    return {
        "name": name,
        "cluster": cluster,
        "host": f"host-{name}",
        "compute_class": "standard",
        "phase": phase,
        "gpu_type": "H100_SXM",
        "created_at": T0,
    }


def cluster_json(
    name: str = "train", status: str = "queued", *, nodes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "project": "default",
        "cluster_type": "slurm",
        "gpu_type": "H100_SXM",
        "region": "local-1",
        "num_gpus": 16,
        "num_preemptible_gpus": 0,
        "desired_preemptible_gpus": 0,
        "allocated_preemptible_gpus": 0,
        "billing_type": "on_demand",
        "status": status,
        "status_message": "no hosts left" if status == "failed" else "",
        "phase_history": [{"phase": status, "timestamp": T0, "message": ""}],
        "nodes": nodes or [],
        "created_at": T0,
        "updated_at": T0,
    }


def ok(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


def err(status: int, code: str, *, message: str, field: str | None = None) -> httpx.Response:
    return httpx.Response(status, json={"code": code, "message": message, "field": field})


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUCLUSTERS_HOME", str(tmp_path / "home"))
    for var in ("GPUCLUSTERS_URL", "GPUCLUSTERS_API_KEY", "GPUCLUSTERS_PROJECT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def client(api: FakeApi) -> Iterator[Client]:
    with Client(URL, "gpc_secret", "default", transport=httpx.MockTransport(api)) as c:
        yield c


# --- request shape and parsing ---------------------------------------------------------


def test_create_sends_model_to_project_path_with_bearer_key(api: FakeApi, client: Client) -> None:
    api.on("POST", "/v1/projects/default/clusters", ok(cluster_json(), 201))
    spec = ClusterCreate(name="train", cluster_type=ClusterType.SLURM, num_gpus=16)

    cluster = client.clusters.create(spec)

    assert isinstance(cluster, Cluster)
    assert cluster.status is ClusterStatus.QUEUED
    request = api.requests[0]
    assert request.headers["Authorization"] == "Bearer gpc_secret"
    body = json.loads(request.content)
    assert body == spec.model_dump(mode="json")


def test_update_sends_only_fields_set(api: FakeApi, client: Client) -> None:
    api.on("PATCH", "/v1/projects/default/clusters/train", ok(cluster_json(status="ready")))

    client.clusters.update("train", ClusterUpdate(num_preemptible_gpus=8))

    assert json.loads(api.requests[0].content) == {"num_preemptible_gpus": 8}


def test_query_parameters_and_project_switch(api: FakeApi, client: Client) -> None:
    api.on("DELETE", "/v1/projects/research/clusters/train", ok(cluster_json(status="deleting")))
    api.on("GET", "/v1/projects/research/nodes", ok([node_json("train-0")]))

    client.project = "research"
    client.clusters.delete("train", delete_volume=True)
    nodes = client.nodes.list("train", include_deleted=True)

    assert dict(api.requests[0].url.params) == {"delete_volume": "true"}
    assert dict(api.requests[1].url.params) == {
        "cluster": "train",
        "include_deleted": "true",
        "limit": "1000",
    }
    assert nodes == [Node.model_validate(node_json("train-0"))]


def test_lists_follow_every_page_and_one_page_can_be_asked_for(
    api: FakeApi, client: Client
) -> None:
    path = "/v1/projects/default/nodes"
    api.on(
        "GET",
        path,
        httpx.Response(200, json=[node_json("a-0")], headers={"X-Next-Cursor": "c1"}),
        httpx.Response(200, json=[node_json("a-1")], headers={"X-Next-Cursor": "c2"}),
        ok([node_json("a-2")]),
        httpx.Response(200, json=[node_json("a-0")], headers={"X-Next-Cursor": "c1"}),
    )
    assert [n.name for n in client.nodes.list()] == ["a-0", "a-1", "a-2"]
    assert [dict(r.url.params).get("cursor") for r in api.requests] == [None, "c1", "c2"]

    page = client.nodes.page(limit=1)
    assert [n.name for n in page.items] == ["a-0"] and page.next_cursor == "c1"
    assert dict(api.requests[-1].url.params) == {"limit": "1"}


def test_optional_query_parameters_are_omitted(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/projects/default/events", ok([]))
    api.on("DELETE", "/v1/projects/default/clusters/train", ok(cluster_json(status="deleting")))

    assert client.events.list() == []
    client.clusters.delete("train")

    # Unset filters (cluster, node) are left out; the list asks for full pages.
    assert dict(api.requests[0].url.params) == {"limit": "1000"}
    assert not api.requests[1].url.params


def test_whoami_and_org_paths_ignore_project(api: FakeApi, client: Client) -> None:
    me = {
        "user": "admin",
        "organization": "org",
        "is_admin": True,
        "projects": {"default": "admin"},
    }
    api.on("GET", "/v1/whoami", ok(me))
    api.on("GET", "/v1/gpu-types", ok([]))

    assert client.whoami() == WhoAmI.model_validate(me)
    assert client.gpu_types.list() == []


def test_answer_that_is_not_the_model_raises_unexpected_response(
    api: FakeApi, client: Client
) -> None:
    api.on("GET", "/v1/projects/default/clusters/train", ok({"name": "train"}))
    api.on("GET", "/v1/projects/default/clusters", ok({"not": "a list"}))

    with pytest.raises(UnexpectedResponseError, match="not a Cluster"):
        client.clusters.get("train")
    with pytest.raises(UnexpectedResponseError, match="JSON array"):
        client.clusters.list()


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (422, "invalid_input", ValidationError),
        (401, "unauthenticated", AuthenticationError),
        (403, "forbidden", PermissionDeniedError),
        (404, "not_found", NotFoundError),
        (409, "already_exists", AlreadyExistsError),
        (409, "capacity_unavailable", CapacityUnavailableError),
        (409, "invalid_state", InvalidStateError),
        (409, "conflict", ConflictError),
        (500, "internal", ServerError),
    ],
)
def test_error_bodies_become_domain_errors(
    api: FakeApi, client: Client, status: int, code: str, cls: type[GpuClustersError]
) -> None:
    api.on(
        "GET",
        "/v1/projects/default/clusters/x",
        err(status, code, message="it went wrong", field="name"),
    )

    with pytest.raises(cls) as caught:
        client.clusters.get("x")

    assert type(caught.value) is cls
    assert caught.value.code == code
    assert caught.value.message == "it went wrong"
    assert caught.value.field == "name"


def test_credentials_posts_context_name_and_parses_the_kubeconfig(
    api: FakeApi, client: Client
) -> None:
    api.serve_credentials("train", user="alice")

    creds = client.clusters.credentials("train", context_name="lab-train")

    assert isinstance(creds, ClusterCredentials)
    assert (creds.cluster, creds.context, creds.user) == ("train", "lab-train", "alice")
    config = kubeconfig.load(creds.kubeconfig)
    assert config["current-context"] == "lab-train"
    request = api.requests[0]
    assert request.method == "POST"
    assert request.url.path == "/v1/projects/default/clusters/train/credentials"
    assert json.loads(request.content) == {"context_name": "lab-train"}

    assert client.clusters.credentials("train").context == "train"
    assert json.loads(api.requests[1].content) == {"context_name": None}


def test_credentials_of_a_cluster_without_kubernetes_is_invalid_state(
    api: FakeApi, client: Client
) -> None:
    api.on(
        "POST",
        "/v1/projects/default/clusters/train/credentials",
        err(409, "invalid_state", message="cluster train is waiting_for_nodes, not ready"),
    )

    with pytest.raises(InvalidStateError, match="not ready"):
        client.clusters.credentials("train")


def test_unknown_error_code_stays_visible(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/regions", err(418, "teapot", message="short and stout"))

    with pytest.raises(GpuClustersError) as caught:
        client.regions.list()

    assert caught.value.code == "teapot"


def test_non_api_error_bodies_are_mapped_by_status(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/regions", httpx.Response(405, json={"detail": "Method Not Allowed"}))
    api.on("GET", "/v1/hosts", httpx.Response(502, text="<html>Bad gateway</html>"))
    api.on("GET", "/v1/projects", httpx.Response(403, text=""))

    with pytest.raises(GpuClustersError, match="Method Not Allowed"):
        client.regions.list()
    with pytest.raises(ServerError, match="HTTP 502 Bad Gateway: <html>"):
        client.hosts.list()
    with pytest.raises(PermissionDeniedError, match="HTTP 403"):
        client.projects.list()


def test_connection_failure_names_the_url() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with (
        Client(URL, None, transport=httpx.MockTransport(refuse)) as client,
        pytest.raises(ConnectionFailedError) as caught,
    ):
        client.whoami()

    assert caught.value.code == "connection_failed"
    assert URL in caught.value.message
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


def test_timeout_is_a_connection_failure() -> None:
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("", request=request)

    with (
        Client(URL, None, transport=httpx.MockTransport(hang)) as client,
        pytest.raises(ConnectionFailedError, match="did not answer in time"),
    ):
        client.regions.list()


def test_malformed_url_is_a_config_error() -> None:
    with pytest.raises(ClientConfigError, match="http://host:port"):
        Client("localhost:8470", None)


# --- wait --------------------------------------------------------------------------------


def test_wait_returns_on_ready_and_reports_changes(api: FakeApi, client: Client) -> None:
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json(status="waiting_for_nodes")),
        ok(cluster_json(status="waiting_for_nodes")),  # unchanged: no callback
        ok(cluster_json(status="waiting_for_nodes", nodes=[node_json("n0", "booting")])),
        ok(cluster_json(status="ready", nodes=[node_json("n0")])),
    )
    seen: list[tuple[ClusterStatus, list[NodePhase]]] = []

    cluster = client.clusters.wait(
        "train",
        on_change=lambda c: seen.append((c.status, [n.phase for n in c.nodes])),
        interval=0,
    )

    assert cluster.status is ClusterStatus.READY
    assert seen == [
        (ClusterStatus.WAITING_FOR_NODES, []),
        (ClusterStatus.WAITING_FOR_NODES, [NodePhase.BOOTING]),
        (ClusterStatus.READY, [NodePhase.RUNNING]),
    ]
    assert len(api.requests) == 4


def test_wait_raises_when_cluster_fails(api: FakeApi, client: Client) -> None:
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json(status="waiting_for_nodes")),
        ok(cluster_json(status="failed")),
    )

    with pytest.raises(ClusterFailedError, match="no hosts left") as caught:
        client.clusters.wait("train", interval=0)

    assert caught.value.code == "cluster_failed"
    assert caught.value.cluster.status is ClusterStatus.FAILED


def test_wait_for_ready_stops_if_cluster_is_deleted(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/projects/default/clusters/train", ok(cluster_json(status="deleting")))

    with pytest.raises(InvalidStateError, match="will not become ready"):
        client.clusters.wait("train", interval=0)


def test_wait_deleted_returns_last_state_on_404(api: FakeApi, client: Client) -> None:
    api.on(
        "GET",
        "/v1/projects/default/clusters/train",
        ok(cluster_json(status="deleting", nodes=[node_json("n0", "draining")])),
        ok(cluster_json(status="deleting")),
        err(404, "not_found", message="cluster train not found"),
    )

    last = client.clusters.wait("train", until="deleted", interval=0)

    assert last is not None
    assert last.status is ClusterStatus.DELETING
    assert last.nodes == []
    assert len(api.requests) == 3


def test_wait_deleted_on_already_gone_cluster_returns_none(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/projects/default/clusters/gone", err(404, "not_found", message="gone"))

    assert client.clusters.wait("gone", until="deleted", interval=0) is None


def test_wait_times_out(api: FakeApi, client: Client) -> None:
    api.on("GET", "/v1/projects/default/clusters/train", ok(cluster_json(status="queued")))

    with pytest.raises(WaitTimeoutError, match="still queued"):
        client.clusters.wait("train", timeout=0, interval=0)


# --- configuration -------------------------------------------------------------------------


def test_config_precedence_file_then_env_then_args(tmp_path: Path) -> None:
    home = tmp_path / "cfg"
    write_config(home, url="http://file:1", api_key="file-key", project="file-project")

    from_file = ClientConfig.load(home=home, environ={})
    from_env = ClientConfig.load(
        home=home,
        environ={"GPUCLUSTERS_URL": "http://env:2", "GPUCLUSTERS_PROJECT": "env-project"},
    )
    from_args = ClientConfig.load(
        home=home,
        environ={"GPUCLUSTERS_URL": "http://env:2", "GPUCLUSTERS_PROJECT": "env-project"},
        url="http://arg:3",
    )

    assert from_file == ClientConfig("http://file:1", "file-key", "file-project")
    assert from_env == ClientConfig("http://env:2", "file-key", "env-project")
    assert from_args == ClientConfig("http://arg:3", "file-key", "env-project")


def test_config_defaults_and_empty_env_values(tmp_path: Path) -> None:
    config = ClientConfig.load(home=tmp_path / "none", environ={"GPUCLUSTERS_PROJECT": ""})

    assert config == ClientConfig("http://127.0.0.1:8470", None, "default")


def test_from_config_reads_gpuclusters_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_config(tmp_path / "home", url="http://file:1", api_key="k", project="p")
    monkeypatch.setenv("GPUCLUSTERS_PROJECT", "from-env")

    with Client.from_config() as client:
        assert client.url == "http://file:1"
        assert client.project == "from-env"


def test_write_config_is_private_and_atomic(tmp_path: Path) -> None:
    home = tmp_path / "new" / "home"
    old_umask = os.umask(0o000)  # even a permissive umask must not loosen the file
    try:
        path = write_config(home, url="http://x:1", api_key="secret", project="p")
        path = write_config(home, url="http://x:2", api_key="secret2", project="p")
    finally:
        os.umask(old_umask)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in home.iterdir()) == ["config.toml"]  # no temp files left
    stored = read_config(home)
    assert (stored.url, stored.api_key, stored.project) == ("http://x:2", "secret2", "p")


def test_read_config_rejects_bad_files(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("url = [")
    with pytest.raises(ClientConfigError, match="not valid TOML"):
        read_config(tmp_path)

    (tmp_path / "config.toml").write_text("url = 5\n")
    with pytest.raises(ClientConfigError, match="url must be a string") as caught:
        read_config(tmp_path)
    assert caught.value.field == "url"


def test_fixture_data_matches_shared_models() -> None:
    # Sanity check of the fixture data against the shared models.
    cluster = Cluster.model_validate(cluster_json(nodes=[node_json("n0")]))
    assert cluster.created_at == datetime(2025, 1, 1, tzinfo=UTC)
