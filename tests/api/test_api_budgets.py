"""Budgets (core/budgets.py, controllers/budgets.py): alerts at 50, 80 and
100 % (listed, and POSTed to the project's webhook), then the policy after
the grace period: pause (preemptible targets 0, no new nodes, standard
nodes kept), stop (nodes released, clusters suspended, volumes kept), and
both lifted when credit returns. Spending is moved forward by back-dating
the usage records (a fast clock), so no test waits for money to be spent.
Also usage reports by user and by cluster."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from gpuclusters.server.controllers.budgets import enforce_budgets
from gpuclusters.server.db.models import UsageRecord, utcnow
from support.api import ApiHarness

P = "/v1/projects/default"
H100_GPU_HOUR = 2.99  # core/pricing.py's list price


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    # The test runs every budget pass itself (housekeeping's would race it).
    return {"budget_grace_s": 0, "housekeeping_interval_s": 3600}


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()


async def spend(api: ApiHarness, hours: float) -> None:
    """Make every open standard usage record look ``hours`` old (the
    preemptible ones accrue only the test's seconds)."""
    async with api.runtime.sessionmaker() as session:
        await session.execute(
            update(UsageRecord)
            .where(UsageRecord.ended_at.is_(None), UsageRecord.compute_class == "standard")
            .values(started_at=utcnow() - timedelta(hours=hours))
        )
        await session.commit()


async def budget(api: ApiHarness) -> dict[str, Any]:
    r = await api.client.get(f"{P}/budget")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_thresholds_then_pause_then_stop_then_resume(
    api: ApiHarness, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    url, received = webhook
    r = await api.client.post(
        f"{P}/clusters",
        json={"name": "b", "cluster_type": "slurm", "num_gpus": 8, "num_preemptible_gpus": 8},
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("b", {"ready"})
    # One standard node metered (8 GPUs); 100 USD is spent in 100 / 23.92 h.
    r = await api.client.put(
        f"{P}/budget",
        json={"kind": "monthly", "amount": 100, "policy": "pause", "webhook_url": url},
    )
    assert r.status_code == 200, r.text
    rate = 8 * H100_GPU_HOUR
    rt = api.runtime
    await spend(api, 55 / rate)  # 55 %
    await enforce_budgets(rt)
    await enforce_budgets(rt)  # once per period, however many passes
    assert [a["percent"] for a in (await budget(api))["alerts"]] == [50]
    await spend(api, 85 / rate)
    await enforce_budgets(rt)
    state = await budget(api)
    assert [a["percent"] for a in state["alerts"]] == [80, 50]
    assert state["enforced"] is None and 84 < state["percent"] < 90

    # Spent: 100 % and, the grace being 0 here, the pause.
    await spend(api, 101 / rate)
    await enforce_budgets(rt)
    state = await budget(api)
    assert state["enforced"] == "pause"
    assert [a["kind"] for a in state["alerts"][:2]] == ["enforced", "threshold"]
    assert state["alerts"][1]["percent"] == 100
    assert [(b["kind"], b["percent"]) for b in received] == [
        ("threshold", 50), ("threshold", 80), ("threshold", 100), ("enforced", 101),
    ]  # fmt: skip
    assert received[0]["project"] == "default" and received[0]["currency"] == "USD"
    cluster = (await api.client.get(f"{P}/clusters/b")).json()
    assert cluster["num_preemptible_gpus"] == 0
    standard = [n for n in cluster["nodes"] if n["compute_class"] == "standard"]
    assert len(standard) == 1 and standard[0]["phase"] == "running"  # kept
    refused = await api.client.post(
        f"{P}/clusters", json={"name": "c", "cluster_type": "slurm", "num_gpus": 8}
    )
    assert refused.status_code == 409 and refused.json()["code"] == "budget_exhausted"
    scale = await api.client.patch(f"{P}/clusters/b", json={"num_gpus": 16})
    assert scale.status_code == 409 and "budget is spent" in scale.json()["message"]
    assert len((await api.client.get(f"{P}/clusters")).json()) == 1
    # The console's pages carry the banner.
    async with httpx.AsyncClient(
        transport=api.client._transport, base_url=str(api.client.base_url)
    ) as browser:
        assert (await browser.post("/login", data={"api_key": api.admin_key})).status_code == 303
        for page in ("/", "/projects/default/clusters/b"):
            html = (await browser.get(page)).text
            assert "budget-banner" in html and "Policy pause in force" in html, page

    # The policy becomes stop: nodes go, the cluster waits suspended, the
    # volume stays.
    r = await api.client.put(
        f"{P}/budget",
        json={"kind": "monthly", "amount": 100, "policy": "stop", "webhook_url": url},
    )
    assert r.status_code == 200, r.text
    await enforce_budgets(rt)
    suspended = await api.wait_cluster("b", {"suspended"})
    assert "budget" in suspended["status_message"]

    async def nodes_gone() -> bool:
        c = (await api.client.get(f"{P}/clusters/b")).json()
        return not c["nodes"]

    for _ in range(400):
        if await nodes_gone():
            break
        await asyncio.sleep(0.05)
    assert await nodes_gone()
    volumes = (await api.client.get(f"{P}/volumes")).json()
    assert len(volumes) == 1 and volumes[0]["status"] != "deleted"
    r = await api.client.delete(f"{P}/budget")
    assert r.status_code == 409 and "raise the amount" in r.text

    # Credit returns (the amount is raised): the cluster comes back.
    r = await api.client.put(
        f"{P}/budget", json={"kind": "monthly", "amount": 10_000, "policy": "stop"}
    )
    assert r.status_code == 200, r.text
    await enforce_budgets(rt)
    back = await api.wait_cluster("b", {"ready"})
    assert len(back["nodes"]) == 1
    state = await budget(api)
    assert state["enforced"] is None and state["alerts"][0]["kind"] == "lifted"
    r = await api.client.delete(f"{P}/budget")
    assert r.status_code == 200 and r.json()["budget"] is None


async def test_only_org_admins_set_budgets_and_bad_ones_are_refused(api: ApiHarness) -> None:
    for body, field in (
        ({"kind": "weekly", "amount": 10}, "kind"),
        ({"kind": "monthly", "amount": 0}, "amount"),
        ({"kind": "monthly", "amount": 10, "policy": "delete"}, "policy"),
        ({"kind": "monthly", "amount": 10, "webhook_url": "ftp://x"}, "webhook_url"),
    ):
        r = await api.client.put(f"{P}/budget", json=body)
        assert r.status_code == 422 and field in r.text, (body, r.text)
    assert (await budget(api))["budget"] is None
    r = await api.client.post(
        "/v1/api-keys", json={"user": "eve", "project": "default", "role": "admin"}
    )
    assert r.status_code == 201, r.text
    async with api.as_key(r.json()["key"]) as eve:
        r = await eve.put(f"{P}/budget", json={"kind": "credit", "amount": 5})
        assert r.status_code == 403
        assert (await eve.get(f"{P}/budget")).status_code == 200


async def test_usage_by_user_and_cluster(api: ApiHarness) -> None:
    for name in ("u1", "u2"):
        r = await api.client.post(
            f"{P}/clusters", json={"name": name, "cluster_type": "slurm", "num_gpus": 8}
        )
        assert r.status_code == 201, r.text
        await api.wait_cluster(name, {"ready"})
    await spend(api, 1.0)
    r = await api.client.get(f"{P}/usage", params={"by": "cluster"})
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["by"] == "cluster"
    assert [g["key"] for g in report["groups"]] == ["u1", "u2"]
    assert all(7.9 < g["gpu_hours"] < 8.2 for g in report["groups"])
    r = await api.client.get(f"{P}/usage", params={"by": "user"})
    groups = r.json()["groups"]
    assert [g["key"] for g in groups] == ["admin"] and 15.9 < groups[0]["gpu_hours"] < 16.3
    assert abs(groups[0]["cost"] - r.json()["total_cost"]) < 0.01
    r = await api.client.get(f"{P}/usage", params={"by": "team"})
    assert r.status_code == 422 and "by" in r.text
