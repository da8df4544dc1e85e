"""The metrics API against a real VictoriaMetrics: who may scrape the
server and the node targets, and PromQL queries confined to the caller's
projects whatever the query says (services/metrics.py)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from gpuclusters.server.db.models import Host, Node, Project
from gpuclusters.server.settings import Settings
from support.api import ApiHarness
from support.processes import free_port

VM_BIN = Settings().metrics_db_bin
pytestmark = pytest.mark.skipif(
    not VM_BIN.is_file(), reason="run scripts/build-k8s-addons (VictoriaMetrics) first"
)
P = "/v1/projects/default"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"metrics_db": "on", "metrics_db_port": free_port(), "metrics_alert_port": free_port()}


async def _key(api: ApiHarness, *, user: str, project: str, role: str = "editor") -> str:
    r = await api.client.post("/v1/api-keys", json={"user": user, "project": project, "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def _project_id(api: ApiHarness, name: str) -> str:
    async with api.runtime.sessionmaker() as session:
        pid = await session.scalar(select(Project.id).where(Project.name == name))
    assert pid
    return str(pid)


async def test_server_metrics_and_targets_are_for_the_scrape_token_and_org_admins(
    api: ApiHarness,
) -> None:
    await api.client.get(f"{P}/clusters")
    editor = await _key(api, user="ed", project="default")
    token = api.runtime.metrics_scrape_token
    assert token and (api.settings.home / "metrics" / "scrape-token").read_text() == token
    for path in ("/metrics", "/v1/metrics/targets"):
        async with api.as_key("") as anonymous:
            anonymous.headers.pop("Authorization")
            assert (await anonymous.get(path)).status_code == 401, path
        async with api.as_key(editor) as c:
            r = await c.get(path)
            assert r.status_code == 403 and r.json()["code"] == "forbidden", path
        async with api.as_key("not-the-token") as c:
            assert (await c.get(path)).status_code == 401, path
        async with api.as_key(token) as c:
            assert (await c.get(path)).status_code == 200, path
        assert (await api.client.get(path)).status_code == 200, path
    metrics = (await api.client.get("/metrics")).text
    assert 'route="/v1/projects/{project}/clusters"' in metrics


async def test_targets_list_running_nodes_with_their_labels(api: ApiHarness) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "m1", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("m1", {"ready"})
    assert (await api.client.get("/v1/metrics/targets")).json() == [], (
        "the fake provider's nodes have no address, so no agent to scrape"
    )
    async with api.runtime.sessionmaker() as session, session.begin():
        names = sorted((await session.scalars(select(Node.name))).all())
        for i, name in enumerate(names):
            await session.execute(
                update(Node).where(Node.name == name).values(address=f"10.231.9.{10 + i}")
            )
    found = (await api.client.get("/v1/metrics/targets")).json()
    port = api.settings.metrics_agent_port
    assert [t["targets"] for t in found] == [[f"10.231.9.{10 + i}:{port}"] for i in range(2)]
    labels = found[0]["labels"]
    assert labels["project"] == "default" and labels["cluster"] == "m1"
    assert labels["project_id"] == await _project_id(api, "default")
    assert labels["node"] == names[0] and labels["gpu_type"] and labels["host"]
    # A node on a host with a host agent (another machine, whose cluster
    # bridge is not routed here) is scraped through that agent, over HTTPS.
    async with api.runtime.sessionmaker() as session, session.begin():
        row = await session.execute(select(Node.id, Node.host_id).where(Node.name == names[1]))
        node_id, host_id = row.one()
        await session.execute(
            update(Host)
            .where(Host.id == host_id)
            .values(agent_status="ready", address="10.232.7.3", agent_port=8471)
        )
    hosted = (await api.client.get("/v1/metrics/targets")).json()[1]
    assert hosted["targets"] == ["10.232.7.3:8471"]
    assert {k: v for k, v in hosted["labels"].items() if k.startswith("__") or k == "instance"} == {
        "__scheme__": "https",
        "__metrics_path__": f"/v1/nodes/{node_id}/metrics",
        "__param_port": str(port),
        "instance": f"10.231.9.11:{port}",
    }
    assert hosted["labels"]["node_id"] == node_id and hosted["labels"]["project_id"]
    # ... and not at all once its host is removed (no agent to ask)
    async with api.runtime.sessionmaker() as session, session.begin():
        await session.execute(update(Host).where(Host.id == host_id).values(agent_status="removed"))
    assert [t["labels"]["node"] for t in (await api.client.get("/v1/metrics/targets")).json()] == [
        names[0]
    ]
    async with api.runtime.sessionmaker() as session, session.begin():
        await session.execute(update(Host).where(Host.id == host_id).values(agent_status=None))
    # a node being released is no longer scraped
    async with api.runtime.sessionmaker() as session, session.begin():
        await session.execute(update(Node).where(Node.name == names[0]).values(phase="releasing"))
    assert [t["labels"]["node"] for t in (await api.client.get("/v1/metrics/targets")).json()] == [
        names[1]
    ]


def _import(url: str, lines: list[str]) -> None:
    r = httpx.post(f"{url}/api/v1/import/prometheus", content="\n".join(lines) + "\n", timeout=10)
    assert r.status_code == 204, r.text


async def _series(client: httpx.AsyncClient, expr: str, **params: str) -> list[dict[str, str]]:
    r = await client.get("/v1/metrics/query", params={"query": expr, **params})
    assert r.status_code == 200, r.text
    return [item["metric"] for item in r.json()["data"]["result"]]


async def test_queries_see_only_the_callers_projects(api: ApiHarness) -> None:
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    a, b = await _project_id(api, "default"), await _project_id(api, "other")
    alice = await _key(api, user="alice", project="default")
    bob = await _key(api, user="bob", project="other")
    url = api.settings.metrics_query_url
    assert url is not None
    now = int(time.time() * 1000)
    _import(url, [
        f'DCGM_FI_DEV_GPU_UTIL{{project_id="{a}",project="default",cluster="ca",gpu="0"}} 71 {now}',
        f'DCGM_FI_DEV_GPU_UTIL{{project_id="{b}",project="other",cluster="cb",gpu="0"}} 42 {now}',
        f'gpuclusters_fleet_nodes{{phase="running"}} 3 {now}',  # the server's: no project
    ])  # fmt: skip
    deadline = time.monotonic() + 30
    imported = '{__name__=~"DCGM_FI_DEV_GPU_UTIL|gpuclusters_fleet_nodes"}'
    while len(await _series(api.client, imported)) < 3:
        assert time.monotonic() < deadline, "VictoriaMetrics never showed the imported series"
        await asyncio.sleep(0.2)

    # Without the server in between, anyone reaching the database reads
    # project "default"'s series by naming them: the boundary is the API.
    async with httpx.AsyncClient() as http:
        direct = await http.get(
            f"{url}/api/v1/query", params={"query": 'DCGM_FI_DEV_GPU_UTIL{cluster="ca"}'}
        )
    assert [m["metric"]["project"] for m in direct.json()["data"]["result"]] == ["default"]

    async with api.as_key(bob) as c:
        assert await _series(c, 'DCGM_FI_DEV_GPU_UTIL{cluster="ca"}') == []
        assert await _series(c, f'DCGM_FI_DEV_GPU_UTIL{{project_id="{a}"}}') == []
        assert {m["project"] for m in await _series(c, '{__name__=~".+"}')} == {"other"}
        # a function over another project's series, a label rewrite, a join
        assert await _series(c, 'sum by (cluster) (DCGM_FI_DEV_GPU_UTIL{cluster="ca"})') == []
        rewritten = 'label_replace(DCGM_FI_DEV_GPU_UTIL, "project_id", "x", "", "")'
        assert {m.get("project") for m in await _series(c, rewritten)} == {"other"}
        r = await c.get("/v1/metrics/query", params={"query": "up", "project": "default"})
        assert r.status_code == 404 and r.json()["field"] == "project"
        r = await c.get(
            "/v1/metrics/query_range",
            params={"query": 'DCGM_FI_DEV_GPU_UTIL{cluster="ca"}', "start": str(now / 1000 - 60),
                    "step": "15s"},
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["data"] == {"resultType": "matrix", "result": []}
    async with api.as_key(alice) as c:
        assert [m["cluster"] for m in await _series(c, "DCGM_FI_DEV_GPU_UTIL")] == ["ca"]
        assert await _series(c, "gpuclusters_fleet_nodes") == [], "operator series"
        r = await c.get(
            "/v1/metrics/query_range",
            params={"query": "DCGM_FI_DEV_GPU_UTIL", "start": str(now / 1000 - 60),
                    "end": str(now / 1000 + 1), "step": "15s"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert [x["metric"]["cluster"] for x in r.json()["data"]["result"]] == ["ca"]
    # organization admins are operators: everything
    everything = await _series(api.client, '{__name__=~".+"}')
    assert {m.get("project") for m in everything if "project" in m} == {"default", "other"}
    assert "gpuclusters_fleet_nodes" in {m["__name__"] for m in everything}
    assert [m["cluster"] for m in await _series(api.client, "DCGM_FI_DEV_GPU_UTIL",
                                                 project="other")] == ["cb"]  # fmt: skip


async def test_bad_queries_are_refused_with_the_field_named(api: ApiHarness) -> None:
    for expr in ("", "sum(", "rate(x[5m]"):
        r = await api.client.get("/v1/metrics/query", params={"query": expr})
        assert r.status_code == 422, (expr, r.text)
        assert r.json()["field"] == "query", r.text
        assert r.json()["message"].startswith("query: "), r.text
    for path, params, field in (
        ("query", {"time": "yesterday"}, "time"),
        ("query_range", {"start": "soon"}, "start"),
        ("query_range", {"start": "0", "end": "1e", "step": "15s"}, "end"),
        ("query_range", {"start": "0", "step": "15 s"}, "step"),
    ):
        r = await api.client.get(f"/v1/metrics/{path}", params={"query": "up", **params})
        assert r.status_code == 422, (params, r.text)
        assert r.json()["field"] == field and r.json()["message"].startswith(f"{field}: ")
    r = await api.client.get(
        "/v1/metrics/query_range",
        params={"query": "up", "start": "2026-01-01T00:00:00Z", "end": "1767225660", "step": "1m"},
    )
    assert r.status_code == 200, r.text


async def test_no_metrics_database_is_a_clear_conflict(tmp_path: Path) -> None:
    from gpuclusters.server.app import create_app
    from support.api import make_settings

    settings = make_settings(tmp_path / "home", None, metrics_db="off")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        from gpuclusters.core.clientconfig import read_config

        key = read_config(settings.home).api_key
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://testserver",
            headers={"Authorization": f"Bearer {key}"},
        ) as client:
            r = await client.get("/v1/metrics/query", params={"query": "up"})
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "invalid_state"
    assert "GPUCLUSTERS_METRICS_DB" in r.json()["message"]


def _sample(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


async def test_server_metrics_count_the_fleet(api: ApiHarness) -> None:
    from gpuclusters.server import fleet_metrics

    r = await api.client.post(
        f"{P}/clusters", json={"name": "f1", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("f1", {"ready"})
    async with api.runtime.sessionmaker() as session:
        await fleet_metrics.refresh(session)
    text = (await api.client.get("/metrics")).text
    assert _sample(text, "gpuclusters_nodes", phase="running", compute_class="standard") == 2
    assert _sample(text, "gpuclusters_clusters", status="ready") == 1
    types = {t["name"]: t for t in (await api.client.get("/v1/gpu-types")).json()}
    h100 = types["H100_SXM"]["total_hosts"] * 8
    assert _sample(text, "gpuclusters_gpus", gpu_type="H100_SXM", state="standard") == 16
    assert _sample(text, "gpuclusters_gpus", gpu_type="H100_SXM", state="free") == h100 - 16
    # the reconcilers' own: a pass ran, nothing is left waiting
    assert (_sample(text, "gpuclusters_reconcile_last_full_pass_timestamp_seconds",
                    controller="nodes") or 0) > time.time() - 3600  # fmt: skip
    assert _sample(text, "gpuclusters_reconcile_queue", controller="nodes") == 0
    # a lease that ran out while held (its replica died) awaits take-over
    assert _sample(text, "gpuclusters_leases_expired", table="nodes") == 0
    async with api.runtime.sessionmaker() as session, session.begin():
        victim = (await session.scalars(select(Node.id))).first()
        await session.execute(
            update(Node).where(Node.id == victim).values(
                lock_owner="dead-replica", lock_token="t",
                lock_expires_at=datetime.now(UTC) - timedelta(minutes=1),
            )
        )  # fmt: skip
        await fleet_metrics.refresh(session)
    text = (await api.client.get("/metrics")).text
    assert _sample(text, "gpuclusters_leases_expired", table="nodes") == 1
    # (the next claim takes it over: nothing to put back)
    # deleted: counted no more (the label set is cleared, not left at 2)
    assert (await api.client.delete(f"{P}/clusters/f1")).status_code in (200, 202)
    await api.wait_cluster("f1", {"gone"})
    async with api.runtime.sessionmaker() as session:
        await fleet_metrics.refresh(session)
    text = (await api.client.get("/metrics")).text
    assert _sample(text, "gpuclusters_nodes", phase="running", compute_class="standard") is None
    assert _sample(text, "gpuclusters_gpus", gpu_type="H100_SXM", state="free") == h100


def _firing(node: dict[str, Any], name: str, starts: str, ends: str) -> dict[str, Any]:
    return {
        "labels": {"alertname": name, "severity": "critical", "node_id": node["id"],
                   "project_id": node["project_id"], "node": node["name"]},
        "annotations": {"summary": f"GPU 3 of {node['name']} reported Xid 79"},
        "startsAt": starts,
        "endsAt": ends,
    }  # fmt: skip


async def test_alerts_from_the_rule_engine_become_node_events_once_per_firing(
    api: ApiHarness,
) -> None:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "al", "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("al", {"ready"})
    async with api.runtime.sessionmaker() as session:
        row = (await session.scalars(select(Node))).one()
        node = {"id": row.id, "project_id": row.project_id, "name": row.name}
    path = "/v1/metrics/alerts/api/v2/alerts"
    editor = await _key(api, user="ed", project="default")
    token = api.runtime.metrics_scrape_token
    assert token
    # vmalert's times: nanoseconds, Z
    firing = [_firing(node, "GpuXidError", "2026-01-01T00:00:00.123456789Z",
                      "2999-01-01T00:00:00Z")]  # fmt: skip
    async with api.as_key(editor) as c:
        assert (await c.post(path, json=firing)).status_code == 403, "users may not post alerts"

    async def events() -> list[dict[str, Any]]:
        listed = (await api.client.get(f"{P}/events", params={"limit": 1000})).json()
        return [e for e in listed if e["reason"] == "GpuXidError"]

    async with api.as_key(token) as c:
        r = await c.post(path, json=firing)
        assert r.status_code == 200 and r.json() == {"recorded": 1}, r.text
        # vmalert resends a firing alert: still one event, counted once
        assert (await c.post(path, json=firing)).json() == {"recorded": 0}
        [event] = await events()
        assert event["count"] == 1 and event["node"] == node["name"]
        assert "reported Xid 79" in event["message"] and "metrics alert" in event["message"]
        # resolved: nothing more; another project's label: ignored
        resolved = [_firing(node, "GpuXidError", "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z")]
        assert (await c.post(path, json=resolved)).json() == {"recorded": 0}
        forged = [_firing({**node, "project_id": "x" * 32}, "GpuEccDoubleBit",
                          "2026-01-01T00:00:00Z", "2999-01-01T00:00:00Z")]  # fmt: skip
        assert (await c.post(path, json=forged)).json() == {"recorded": 0}
        # a later firing of the same alert is a new occurrence
        again = [_firing(node, "GpuXidError", "2999-01-01T00:00:00Z", "2999-01-02T00:00:00Z")]
        assert (await c.post(path, json=again)).json() == {"recorded": 1}
        [event] = await events()
        assert event["count"] == 2
        # a fleet alert (no node) is logged, not an event
        fleet = [
            {"labels": {"alertname": "ReconcileLag", "controller": "nodes"},
             "annotations": {"summary": "lag"}, "startsAt": "2026-01-01T00:00:00Z"}
        ]  # fmt: skip
        assert (await c.post(path, json=fleet)).json() == {"recorded": 0}
        assert (await c.post(path, json={"not": "a list"})).status_code == 422
        odd = [
            {"labels": "x"},
            {
                "labels": {
                    "alertname": "A",
                    "node_id": node["id"],
                    "project_id": node["project_id"],
                },
                "annotations": 3,
            },
        ]
        assert (await c.post(path, json=odd)).json() == {"recorded": 1}, "a malformed one skipped"


def _dashboard_queries() -> list[str]:
    root = Path(__file__).resolve().parents[2] / "dashboards"
    boards = sorted(root.glob("*.json"))
    assert boards
    return [
        t["expr"]
        for board in boards
        for panel in json.loads(board.read_text())["panels"]
        for t in panel["targets"]
    ]


async def test_the_dashboards_queries_parse(api: ApiHarness) -> None:
    """Every query of the Grafana dashboards in dashboards/ is accepted by
    the metrics database (with their variables filled in)."""
    exprs = _dashboard_queries()
    assert len(exprs) >= 10
    for expr in exprs:
        filled = re.sub(r"\$[a-z]+", "1", expr)
        r = await api.client.get("/v1/metrics/query", params={"query": filled})
        assert r.status_code == 200, (expr, r.text)


async def test_console_charts_read_the_database(api: ApiHarness) -> None:
    """The node, cluster and job views' charts come from the metrics
    database (so they survive restarts and agree between replicas), only
    the job's own GPUs on a job's, and another project's member gets none."""
    r = await api.client.post(
        f"{P}/clusters", json={"name": "ch", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("ch", {"ready"})
    async with api.runtime.sessionmaker() as session:
        rows = (await session.scalars(select(Node).order_by(Node.name))).all()
        nodes = [(n.id, n.name, n.cluster_id, n.project_id) for n in rows]
    url = api.settings.metrics_query_url
    assert url is not None
    now = int(time.time())
    lines = []
    for at in range(now - 600, now + 1, 15):
        for node_id, name, cluster_id, pid in nodes:
            for gpu in range(8):
                job = ',slurm_job="7"' if name == nodes[1][1] and gpu in (2, 5) else ""
                base = (f'node_id="{node_id}",node="{name}",cluster_id="{cluster_id}",'
                        f'project_id="{pid}",gpu="{gpu}"{job}')  # fmt: skip
                util = 90 if job else 10
                lines += [
                    f"DCGM_FI_DEV_GPU_UTIL{{{base}}} {util} {at * 1000}",
                    f"DCGM_FI_DEV_FB_USED{{{base}}} 2048 {at * 1000}",
                    f"DCGM_FI_DEV_GPU_TEMP{{{base}}} 40 {at * 1000}",
                    f"DCGM_FI_DEV_POWER_USAGE{{{base}}} 300 {at * 1000}",
                ]
    _import(url, lines)
    deadline = time.monotonic() + 30
    while len(await _series(api.client, 'DCGM_FI_DEV_POWER_USAGE{slurm_job="7"}')) < 2:
        assert time.monotonic() < deadline, "VictoriaMetrics never showed the imported series"
        await asyncio.sleep(0.2)

    transport = httpx.ASGITransport(app=api.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as browser:
        assert (await browser.post("/login", data={"api_key": api.admin_key})).status_code == 303
        node = (await browser.get(f"/projects/default/nodes/{nodes[1][1]}/telemetry")).json()
        assert node["gpus"] == [f"GPU {g}" for g in range(8)]
        assert len(node["t"]) >= 30, "about 10 minutes of 15 s samples"
        assert node["utilization_pct"][2][-1] == 90 and node["utilization_pct"][0][-1] == 10
        assert node["memory_used_gib"][0][-1] == 2
        cluster = (await browser.get("/projects/default/clusters/ch/telemetry")).json()
        assert cluster["gpus"] == sorted(n[1] for n in nodes)
        # node 1: 2 GPUs at 90, 6 at 10 -> mean 30
        assert cluster["utilization_pct"][cluster["gpus"].index(nodes[1][1])][-1] == 30
        job = (await browser.get("/projects/default/clusters/ch/workloads/telemetry",
                                 params={"job": "7"})).json()  # fmt: skip
        assert job["gpus"] == [f"{nodes[1][1]} GPU 2", f"{nodes[1][1]} GPU 5"]
        assert job["t"][0] <= now - 600 and job["t"][-1] >= now - 15, "its whole lifetime"
        assert {v for column in job["power_w"] for v in column if v is not None} == {300}
        page = (await browser.get("/projects/default/clusters/ch")).text
        assert 'href="/projects/default/clusters/ch/workloads?job=7"' in page
        view = await browser.get("/projects/default/clusters/ch/workloads", params={"job": "7"})
        assert view.status_code == 200 and "Slurm job 7" in view.text
        assert "/workloads/telemetry?job=7" in view.text
        nothing = (await browser.get("/projects/default/clusters/ch/workloads/telemetry",
                                     params={"job": "8"})).json()  # fmt: skip
        assert nothing["t"] == [] and nothing["gpus"] == []

    # another project's member sees neither the cluster nor its series
    assert (await api.client.post("/v1/projects", json={"name": "other"})).status_code == 201
    bob = await _key(api, user="bob", project="other")
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as browser:
        assert (await browser.post("/login", data={"api_key": bob})).status_code == 303
        r = await browser.get("/projects/default/clusters/ch/workloads/telemetry",
                              params={"job": "7"})  # fmt: skip
        assert r.status_code == 404
