"""Alerts and the repair workflow through the HTTP API (fake provider, no-op
layer). Findings are fed the way heartbeats feed them (``apply_findings``);
the repair reconciler then reboots, reprovisions or migrates fake nodes."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from gpuclusters.core.health import rules
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.alerts import apply_findings, note_missed_heartbeats
from gpuclusters.server.db.models import Alert, Node, Remediation, utcnow
from support.api import ApiHarness

P = "/v1/projects/default"
ECC = {"kind": "ecc_dbe", "severity": "critical", "message": "GPU 2: 1 double-bit ECC error(s)",
       "gpu": 2}  # fmt: skip
XID79 = {"kind": "gpu_missing", "severity": "critical", "message": "GPU 3: Xid 79", "gpu": 3,
         "code": 79}  # fmt: skip


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Automatic repairs settle for 20 s before they start (four heartbeats);
    here findings are fed by hand, so a fraction of a second is enough.
    Tests about faults arriving together set a long window instead."""
    monkeypatch.setattr(rules, "SETTLE_WINDOW", timedelta(seconds=0.2))


def settle(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(rules, "SETTLE_WINDOW", timedelta(seconds=seconds))


async def report(api: ApiHarness, node: str, findings: list[dict[str, Any]]) -> None:
    """What a heartbeat with these findings does."""
    rt = api.runtime
    async with rt.sessionmaker() as session:
        row = await session.scalar(select(Node).where(Node.name == node, Node.deleted_at.is_(None)))
        assert row is not None
        await apply_findings(session, rt=rt, node=row, findings=findings)
        await session.commit()
    rt.hints.notify(hints.REPAIRS)


async def cluster(api: ApiHarness, gpus: int = 40, **repair: Any) -> list[str]:
    body: dict[str, Any] = {"name": "c", "cluster_type": "slurm", "num_gpus": gpus}
    if repair:
        body["repair"] = repair
    r = await api.client.post(f"{P}/clusters", json=body)
    assert r.status_code == 201, r.text
    ready = await api.wait_cluster("c", {"ready"})
    return sorted(n["name"] for n in ready["nodes"])


async def repairs(api: ApiHarness, **params: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"{P}/repairs", params=params)
    r.raise_for_status()
    return list(r.json())


async def until(check: Any, within_s: float = 15) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        value = await check()
        if value:
            return value
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def wait_repair(api: ApiHarness, repair_id: str, states: set[str]) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        r = (await api.client.get(f"{P}/repairs/{repair_id}")).json()
        return r if r["state"] in states else None

    result: dict[str, Any] = await until(done)
    return result


async def test_ecc_needs_approval_then_reboots_and_escalates(api: ApiHarness) -> None:
    nodes = await cluster(api)
    await report(api, nodes[0], [ECC])
    (alert,) = (await api.client.get(f"{P}/alerts")).json()
    assert (alert["kind"], alert["severity"], alert["gpu"]) == ("ecc_dbe", "critical", 2)
    (rem,) = await repairs(api)
    assert (rem["action"], rem["state"], rem["trigger"]) == ("reboot", "pending_approval",
                                                             "automated")  # fmt: skip
    assert "approval" in rem["message"] and rem["alert_ids"] == [alert["id"]]
    # A repeat of the same finding changes nothing.
    await report(api, nodes[0], [ECC])
    assert len(await repairs(api)) == 1

    r = await api.client.post(f"{P}/repairs/{rem['id']}/approve")
    assert r.status_code == 200 and r.json()["reviewed_by"] == "admin"
    done = await wait_repair(api, rem["id"], {"succeeded", "failed"})
    assert done["state"] == "succeeded", done
    node = (await api.client.get(f"{P}/nodes/{nodes[0]}")).json()
    assert node["phase"] == "running" and not node["cordoned"]
    assert (await api.client.get(f"{P}/alerts")).json() == []  # resolved with the repair
    # Approving again answers the same record.
    assert (await api.client.post(f"{P}/repairs/{rem['id']}/approve")).status_code == 200

    # The same fault soon after: one step stronger.
    await report(api, nodes[0], [ECC])
    second = next(r for r in await repairs(api) if r["id"] != rem["id"])
    assert second["action"] == "reprovision"


async def test_reject_cancel_and_auto_resolve(api: ApiHarness) -> None:
    nodes = await cluster(api)
    await report(api, nodes[1], [XID79])
    (rem,) = await repairs(api)
    assert rem["action"] == "migrate"
    r = await api.client.post(f"{P}/repairs/{rem['id']}/reject")
    assert r.json()["state"] == "cancelled" and "rejected by admin" in r.json()["message"]
    r = await api.client.post(f"{P}/repairs/{rem['id']}/approve")
    assert r.status_code == 409 and r.json()["code"] == "invalid_state"

    # A new finding while nothing is open: a new recommendation; when the
    # fault goes away before anyone acts, it resolves itself.
    await report(api, nodes[1], [XID79, ECC])
    waiting = [r for r in await repairs(api) if r["state"] == "pending_approval"]
    assert len(waiting) == 1 and waiting[0]["action"] == "migrate"
    await report(api, nodes[1], [])
    auto = (await api.client.get(f"{P}/repairs/{waiting[0]['id']}")).json()
    assert auto["state"] == "auto_resolved"
    resolved = (await api.client.get(f"{P}/alerts", params={"include_resolved": True})).json()
    assert all(a["resolved_at"] for a in resolved) and len(resolved) == 2

    # Cancel before it starts.
    await report(api, nodes[1], [ECC])
    (pending,) = await repairs(api, state="pending_approval")
    r = await api.client.post(f"{P}/repairs/{pending['id']}/cancel")
    assert r.json()["state"] == "cancelled"


async def test_automatic_policy_and_the_unhealthy_limit(api: ApiHarness) -> None:
    nodes = await cluster(api, automatic=["ecc_dbe"], max_wait_s=0)
    await report(api, nodes[0], [ECC])
    (first,) = await repairs(api)
    assert first["state"] in ("pending", "running", "succeeded") and first["reviewed_by"] is None
    done = await wait_repair(api, first["id"], {"succeeded", "failed"})
    assert done["state"] == "succeeded" and done["message"] == "reboot done; the node runs again"

    # A fault the policy does not name needs approval; so does a node with
    # auto-repair off (its own reason comes before the cluster's count).
    await report(api, nodes[3], [XID79])
    r = await api.client.patch(f"{P}/nodes/{nodes[4]}", json={"auto_repair": False})
    assert r.status_code == 200 and r.json()["auto_repair"] is False
    await report(api, nodes[4], [ECC])
    later = {r["node"]: r for r in await repairs(api, state="pending_approval")}
    assert "policy" in later[nodes[3]]["message"]
    assert "auto-repair is off" in later[nodes[4]]["message"]


@pytest.mark.parametrize("order", ["first-node-first", "second-node-first"])
async def test_two_faults_together_above_the_limit_both_wait_in_either_order(
    api: ApiHarness, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """Two of five nodes report an ECC error within the settle window (more
    than 20%): whichever heartbeat lands first, neither repair starts; both
    wait for a person with the same reason, and neither node is touched."""
    settle(monkeypatch, 60)  # "together": the second report is well within it
    nodes = await cluster(api, automatic=["ecc_dbe"], max_wait_s=0)
    pair = [nodes[0], nodes[1]]
    for node in pair if order == "first-node-first" else pair[::-1]:
        await report(api, node, [ECC])
    paused = "2 of 5 nodes are unhealthy (more than 20%): automatic repair is paused"
    by_node = {r["node"]: r for r in await repairs(api)}
    assert set(by_node) == set(pair)
    for rem in by_node.values():
        assert (rem["state"], rem["trigger"], rem["reviewed_by"]) == (
            "pending_approval", "automated", None
        )  # fmt: skip
        assert (rem["message"], rem["step"], rem["started_at"]) == (paused, None, None)
    for node in pair:
        got = (await api.client.get(f"{P}/nodes/{node}")).json()
        assert (got["phase"], got["cordoned"]) == ("running", False)

    # A person decides: the approved one runs at once, the other waits on.
    first = by_node[pair[0]]
    r = await api.client.post(f"{P}/repairs/{first['id']}/approve")
    assert r.status_code == 200
    assert (await wait_repair(api, first["id"], {"succeeded", "failed"}))["state"] == "succeeded"
    other = (await api.client.get(f"{P}/repairs/{by_node[pair[1]]['id']}")).json()
    assert (other["state"], other["message"]) == ("pending_approval", paused)


async def test_the_start_counts_the_cluster_again(
    api: ApiHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two heartbeats that commit side by side (PostgreSQL, read committed)
    each count only their own node, and both repairs are recorded as
    automatic. The reconciler counts the cluster again in the transaction
    that would start each one, so they end as if they had been seen
    together: both wait for a person, neither started."""
    settle(monkeypatch, 60)
    nodes = await cluster(api, automatic=["ecc_dbe"], max_wait_s=0)
    await report(api, nodes[0], [ECC])
    (seen,) = await repairs(api)
    assert seen["state"] == "pending" and "automatic: starts 60s after" in seen["message"]
    # What the other transaction wrote, without having seen the first one:
    # its alert and its own automatic repair.
    rt = api.runtime
    async with rt.sessionmaker() as session:
        node = await session.scalar(select(Node).where(Node.name == nodes[1]))
        assert node is not None
        alert = Alert(
            project_id=node.project_id,
            cluster_id=node.cluster_id,
            node_id=node.id,
            node_name=node.name,
            kind=ECC["kind"],
            severity="critical",
            gpu=2,
            message=ECC["message"],
        )
        session.add(alert)
        await session.flush()
        session.add(
            Remediation(
                project_id=node.project_id,
                cluster_id=node.cluster_id,
                node_id=node.id,
                node_name=node.name,
                action="reboot",
                state="pending",
                trigger="automated",
                kinds="ecc_dbe",
                requested_by="gpuclusters",
                idempotency_key=f"auto:{node.id}:test:reboot",
                alert_ids=json.dumps([alert.id]),
            )
        )
        await session.commit()
    # The reconciler holds both at its next look, settled or not: over the
    # limit nothing that has not started starts.
    rt.hints.notify(hints.REPAIRS)

    async def decided() -> list[dict[str, Any]] | None:
        rs = await repairs(api)
        return rs if all(r["state"] != "pending" for r in rs) else None

    rs = await until(decided)
    assert [(r["state"], r["started_at"]) for r in rs] == [("pending_approval", None)] * 2
    assert {r["message"] for r in rs} == {
        "2 of 5 nodes are unhealthy (more than 20%): automatic repair is paused"
    }


async def test_a_fault_after_a_repair_started_waits_while_that_node_is_unhealthy(
    api: ApiHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults further apart than the settle window are one after the other:
    the first repair runs alone; the next fault waits for a person while the
    first node still counts as unhealthy. Job protection keeps the first
    repair running here (its node has work and the cluster never drains)."""
    nodes = await cluster(api, automatic=["ecc_dbe"], max_wait_s=-1)

    async def busy(cluster: Any, node: Any) -> int:
        return 1 if node.name == nodes[0] else 0

    monkeypatch.setattr(api.runtime.layer_for("slurm"), "running_work", busy)
    await report(api, nodes[0], [ECC])
    (first,) = await repairs(api)

    async def draining() -> dict[str, Any] | None:
        r = (await api.client.get(f"{P}/repairs/{first['id']}")).json()
        return r if r["step"] == "draining" else None

    await until(draining)
    await report(api, nodes[1], [ECC])
    later = {r["node"]: r for r in await repairs(api)}
    assert (later[nodes[0]]["state"], later[nodes[0]]["step"]) == ("running", "draining")
    assert later[nodes[1]]["state"] == "pending_approval"
    assert "2 of 5 nodes are unhealthy" in later[nodes[1]]["message"]


async def test_warnings_missed_heartbeats_and_manual_repairs(
    api: ApiHarness, monkeypatch: Any
) -> None:
    # The test notes the missed heartbeat itself; the server's housekeeping
    # (every 0.5 s here) would otherwise race it to the same alert.
    monkeypatch.setattr(api.runtime.settings, "heartbeat_timeout_s", 3600.0)
    nodes = await cluster(api, gpus=16)
    disk = {"kind": "disk_pressure", "severity": "warning", "message": "/scratch 2% free"}
    await report(api, nodes[0], [disk])
    assert [a["kind"] for a in (await api.client.get(f"{P}/alerts")).json()] == ["disk_pressure"]
    assert await repairs(api) == []  # warn only

    rt = api.runtime
    async with rt.sessionmaker() as session:
        row = await session.scalar(select(Node).where(Node.name == nodes[1]))
        assert row is not None
        row.last_heartbeat_at = row.ready_at = utcnow() - timedelta(minutes=5)
        await session.commit()
    assert await note_missed_heartbeats(rt, missed_after_s=30) == 1
    assert await note_missed_heartbeats(rt, missed_after_s=30) == 0  # one alert, not two
    alerts = {a["node"]: a for a in (await api.client.get(f"{P}/alerts")).json()}
    assert alerts[nodes[1]]["kind"] == "heartbeat_missed"
    assert alerts[nodes[1]]["severity"] == "critical"
    (rem,) = await repairs(api)
    assert (rem["node"], rem["action"], rem["state"]) == (nodes[1], "reboot", "pending_approval")

    body = {"node": nodes[0], "action": "reprovision", "reason": "flaky", "idempotency_key": "k1"}
    r1 = await api.client.post(f"{P}/repairs", json=body)
    assert r1.status_code == 201, r1.text
    r2 = await api.client.post(f"{P}/repairs", json=body)
    assert r2.json()["id"] == r1.json()["id"]  # idempotent
    r3 = await api.client.post(f"{P}/repairs", json=body | {"idempotency_key": "k2"})
    assert r3.status_code == 409  # one open repair per node
    done = await wait_repair(api, r1.json()["id"], {"succeeded", "failed"})
    assert done["state"] == "succeeded" and done["trigger"] == "manual"


async def test_fault_injection_and_checks_need_the_embedded_fleet(api: ApiHarness) -> None:
    nodes = await cluster(api, gpus=8)
    r = await api.client.post(f"{P}/nodes/{nodes[0]}/faults", json={"kind": "xid", "code": 79})
    assert r.status_code == 409 and "embedded fleet" in r.json()["message"]
    r = await api.client.post(f"{P}/nodes/{nodes[0]}/faults", json={"kind": "xid"})
    assert r.status_code == 422 and "Xid" in r.json()["message"]
    r = await api.client.post(f"{P}/nodes/{nodes[0]}/faults", json={"kind": "meteor"})
    assert r.status_code == 422
    r = await api.client.post(
        "/v1/api-keys", json={"user": "eve", "project": "default", "role": "editor"}
    )
    async with api.as_key(r.json()["key"]) as eve:
        r = await eve.post(f"{P}/nodes/{nodes[0]}/faults", json={"kind": "xid", "code": 79})
        assert r.status_code == 403
        assert (await eve.get(f"{P}/alerts")).status_code == 200

    r = await api.client.post(f"{P}/clusters/c/health-checks", json={"check": "gpu-burn"})
    assert r.status_code == 201, r.text
    (run,) = r.json()

    async def finished() -> dict[str, Any] | None:
        h = (await api.client.get(f"{P}/health-checks/{run['id']}")).json()
        return h if h["state"] not in ("pending", "running") else None

    h = await until(finished)
    assert h["state"] == "skipped" and "no shell" in h["reason"]
    r = await api.client.post(f"{P}/clusters/c/health-checks", json={"check": "dcgm"})
    assert r.status_code == 422


async def test_a_node_that_fails_its_acceptance_tests_is_not_added(
    api: ApiHarness, monkeypatch: Any
) -> None:
    from gpuclusters.server.controllers import nodes as node_controller

    async def verdict(rt: Any, node_id: str, check: str, **_: Any) -> dict[str, Any]:
        if check == "nccl":
            return {"state": "failed", "reason": "busbw 12 GB/s < 300", "metrics": {"busbw": 12}}
        return {"state": "skipped", "reason": "no GPU"}

    monkeypatch.setattr(node_controller, "run_check_on_node", verdict)
    monkeypatch.setattr(api.runtime.settings, "acceptance_checks", ["gpu-burn", "nccl"])
    r = await api.client.post(
        f"{P}/clusters", json={"name": "c", "cluster_type": "slurm", "num_gpus": 8}
    )
    assert r.status_code == 201
    failed = await api.wait_cluster("c", {"failed", "ready"})
    assert failed["status"] == "failed"
    (node,) = failed["nodes"]
    assert node["phase"] == "failed" and "acceptance test nccl failed" in node["message"]
    runs = {h["check"]: h for h in (await api.client.get(f"{P}/health-checks")).json()}
    assert runs["gpu-burn"]["state"] == "skipped" and runs["nccl"]["state"] == "failed"
    assert runs["nccl"]["metrics"] == {"busbw": 12} and runs["nccl"]["requested_by"] == "acceptance"


async def test_an_unknown_fault_in_the_policy_is_refused_naming_the_field(api: ApiHarness) -> None:
    body = {"name": "c", "cluster_type": "slurm", "num_gpus": 8}
    r = await api.client.post(
        f"{P}/clusters", json={**body, "repair": {"automatic": ["ecc_dbe", "no_such"]}}
    )
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["field"] == "repair.automatic"
    assert err["message"].startswith("repair.automatic: unknown fault 'no_such'")
    assert (await api.client.get(f"{P}/clusters/c")).status_code == 404  # nothing made
