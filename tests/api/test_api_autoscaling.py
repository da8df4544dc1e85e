"""Autoscaling through the API and the autoscaler (controllers/autoscaler.py)
with a scripted layer standing in for Slurm's power saving: bad ranges are
refused naming the field and change nothing; slots Slurm asks for get nodes
(once, however often the pass runs); released slots' nodes go unless work
runs there or the cluster would go below min_gpus; quotas bound scale-ups
with an event saying why. The real Slurm half is tested in
tests/slurm/test_stack_netns.py and tests/e2e/test_autoscaling.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpuclusters.core.autoscale import ScaleSignals, SlotState
from gpuclusters.core.enums import ClusterType
from gpuclusters.layers.testing import ScriptedLayer
from gpuclusters.server.controllers.autoscaler import autoscale_pass
from support.api import ApiHarness

P = "/v1/projects/default"


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    # The test drives every pass itself.
    return {"autoscale_interval_s": 60}


@pytest.fixture
def layer(api: ApiHarness) -> ScriptedLayer:
    scripted = ScriptedLayer()
    api.runtime.layers[ClusterType.SLURM] = scripted
    api.runtime.layers[ClusterType.KUBERNETES] = scripted
    return scripted


def slots(*states: tuple[str, str], pending: tuple[str, ...] = ()) -> ScaleSignals:
    """("g-as2", "up"), ("g-as1", "released"), ("g-as3", "busy"), ("g-as4", "on")."""
    return ScaleSignals(
        slots=tuple(
            SlotState(
                name=name,
                wants_up=kind == "up",
                released=kind in ("released", "busy"),
                busy=kind == "busy",
            )
            for name, kind in states
        ),
        pending_jobs=pending,
    )


async def get(api: ApiHarness, name: str) -> dict[str, Any]:
    r = await api.client.get(f"{P}/clusters/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def events(api: ApiHarness, cluster: str, reason: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"{P}/events", params={"cluster": cluster})
    r.raise_for_status()
    return [e for e in r.json() if e["reason"] == reason]


async def all_running(api: ApiHarness, name: str, count: int) -> dict[str, Any]:
    """An autoscaled cluster is ready while its new nodes boot: wait for them."""
    for _ in range(400):
        c = await get(api, name)
        if [n["phase"] for n in c["nodes"]] == ["running"] * count:
            return c
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}: {count} running nodes expected, got {c['nodes']}")


def live(cluster: dict[str, Any]) -> list[str]:
    return sorted(n["name"] for n in cluster["nodes"] if n["phase"] != "deleting")


async def test_bad_ranges_are_refused_and_change_nothing(api: ApiHarness) -> None:
    cases = [
        ({"num_gpus": 0}, "num_gpus: must be at least 8 unless autoscaling is set"),
        (
            {
                "num_gpus": 0,
                "billing_type": "reserved",
                "reservation_start": "2027-01-01T00:00:00Z",
                "reservation_end": "2027-01-03T00:00:00Z",
                "autoscaling": {"max_gpus": 16},
            },
            "autoscaling: on-demand clusters only",
        ),
        ({"num_gpus": 8, "autoscaling": {"min_gpus": 16, "max_gpus": 8}}, "min_gpus"),
        ({"num_gpus": 24, "autoscaling": {"max_gpus": 16}}, "num_gpus: must lie within"),
        ({"num_gpus": 0, "autoscaling": {"max_gpus": 12}}, "multiple of 8"),
        (
            {"num_gpus": 0, "num_preemptible_gpus": 8, "autoscaling": {"max_gpus": 8}},
            "autoscaling: not with num_preemptible_gpus",
        ),
        ({"num_gpus": 0, "autoscaling": {"max_gpus": 8, "idle_s": 5}}, "idle_s"),
    ]
    for extra, message in cases:
        body = {"name": "bad", "cluster_type": "slurm", **extra}
        r = await api.client.post(f"{P}/clusters", json=body)
        assert r.status_code == 422, (body, r.text)
        assert message in r.text, (body, r.text)
    r = await api.client.get(f"{P}/clusters")
    assert r.json() == []


async def test_autoscaler_follows_the_scheduler(api: ApiHarness, layer: ScriptedLayer) -> None:
    body = {
        "name": "g",
        "cluster_type": "slurm",
        "num_gpus": 8,
        "autoscaling": {"min_gpus": 8, "max_gpus": 32, "idle_s": 60},
    }
    r = await api.client.post(f"{P}/clusters", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["autoscaling"] == {"min_gpus": 8, "max_gpus": 32, "idle_s": 60}
    first = live(await api.wait_cluster("g", {"ready"}))
    rt = api.runtime

    # Slurm asks for two more slots for job 7: two nodes, once.
    layer.always("scale_signals", slots(("g-as1", "on"), ("g-as2", "up"), ("g-as3", "up"),
                                        ("g-as4", "on"), pending=("7",)))  # fmt: skip
    await autoscale_pass(rt)
    await autoscale_pass(rt)  # the same view again: nothing more
    grown = await all_running(api, "g", 3)
    assert grown["num_gpus"] == 24 and len(live(grown)) == 3
    ups = await events(api, "g", "ScaledUp")
    assert len(ups) == 2 and all("pending job(s) 7" in e["message"] for e in ups)
    assert {e["message"].split(" as ")[1].split()[0] for e in ups} == {"g-as2", "g-as3"}

    # All three released by Slurm, but a pod still runs on as3's node (the
    # layer counts it): as1's and as2's nodes go, as3's stays.
    node_of = {e["message"].split(" as ")[1].split()[0]: e["node"] for e in ups}
    node_of["g-as1"] = first[0]
    busy = {node_of["g-as3"]}
    original = layer.running_work

    async def running_work(cluster: Any, node: Any) -> int:
        return 1 if node.name in busy else await original(cluster, node)

    layer.running_work = running_work  # type: ignore[method-assign]
    layer.always("scale_signals", slots(("g-as1", "released"), ("g-as2", "released"),
                                        ("g-as3", "released")))  # fmt: skip
    await autoscale_pass(rt)
    shrunk = await get(api, "g")
    assert shrunk["num_gpus"] == 8
    leaving = {e["node"] for e in await events(api, "g", "ScaledDown")}
    assert leaving == {node_of["g-as1"], node_of["g-as2"]}
    downs = await events(api, "g", "ScaledDown")
    assert all("idle for 60 s" in e["message"] for e in downs)
    deferred = {e["node"]: e["message"] for e in await events(api, "g", "ScaleDownDeferred")}
    assert "work still runs there" in deferred[node_of["g-as3"]]

    # The pod is gone: the last node still stays, at min_gpus.
    busy.clear()
    layer.always("scale_signals", slots(("g-as3", "released")))
    await autoscale_pass(rt)
    assert (await get(api, "g"))["num_gpus"] == 8
    deferred = {e["node"]: e["message"] for e in await events(api, "g", "ScaleDownDeferred")}
    assert "the cluster stays at min_gpus (8)" in deferred[node_of["g-as3"]]
    assert len(await events(api, "g", "ScaledDown")) == 2


async def test_quota_bounds_a_scale_up_with_an_event(api: ApiHarness, layer: ScriptedLayer) -> None:
    r = await api.client.put(f"{P}/quota", json={"standard_gpus": 16})
    assert r.status_code == 200, r.text
    body = {"name": "q", "cluster_type": "slurm", "num_gpus": 8,
            "autoscaling": {"max_gpus": 32}}  # fmt: skip
    assert (await api.client.post(f"{P}/clusters", json=body)).status_code == 201
    await api.wait_cluster("q", {"ready"})
    layer.always("scale_signals", slots(("q-as1", "on"), ("q-as2", "up"), ("q-as3", "up"),
                                        pending=("3",)))  # fmt: skip
    await autoscale_pass(api.runtime)
    assert (await get(api, "q"))["num_gpus"] == 16
    blocked = await events(api, "q", "ScaleUpBlocked")
    assert len(blocked) == 1
    assert "standard_gpus" in blocked[0]["message"] and "job(s) 3" in blocked[0]["message"]
    # Asked again at the next pass: still refused, one event (counted), no error.
    await autoscale_pass(api.runtime)
    again = await events(api, "q", "ScaleUpBlocked")
    assert len(again) == 1 and again[0]["count"] == 2


async def test_update_rules(api: ApiHarness, layer: ScriptedLayer) -> None:
    body = {"name": "u", "cluster_type": "slurm", "num_gpus": 8,
            "autoscaling": {"max_gpus": 16}}  # fmt: skip
    assert (await api.client.post(f"{P}/clusters", json=body)).status_code == 201
    fixed = {"name": "f", "cluster_type": "slurm", "num_gpus": 8}
    assert (await api.client.post(f"{P}/clusters", json=fixed)).status_code == 201
    await api.wait_cluster("u", {"ready"})
    for name, change, message in (
        ("u", {"num_gpus": 16}, "num_gpus: an autoscaled cluster's size follows its queue"),
        (
            "u",
            {"num_gpus": 16, "autoscaling": {"max_gpus": 16}},
            "num_gpus: an autoscaled cluster's size follows its queue",
        ),
        ("u", {"num_preemptible_gpus": 8}, "num_preemptible_gpus: not on an autoscaled"),
        ("u", {"autoscaling": {"max_gpus": 8, "min_gpus": 8}}, None),
        ("f", {"autoscaling": {"max_gpus": 16}}, "autoscaling: set it when the cluster"),
    ):
        r = await api.client.patch(f"{P}/clusters/{name}", json=change)
        if message is None:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 422 and message in r.text, r.text
    r = await api.client.patch(f"{P}/clusters/u", json={"autoscaling": {"max_gpus": 0}})
    assert r.status_code == 422 and "max_gpus" in r.text
    # A min above the size adds the nodes at once.
    r = await api.client.patch(
        f"{P}/clusters/u", json={"autoscaling": {"min_gpus": 16, "max_gpus": 24}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["num_gpus"] == 16 and len(r.json()["nodes"]) == 2
    # And a max below the size is refused.
    r = await api.client.patch(
        f"{P}/clusters/u", json={"autoscaling": {"min_gpus": 8, "max_gpus": 8}}
    )
    assert r.status_code == 422 and "autoscaling.max_gpus: below" in r.text


async def test_kubernetes_pods_drive_it(api: ApiHarness, layer: ScriptedLayer) -> None:
    """Pending GPU pods add the nodes they need (less those joining); with
    nothing pending, a node idle past idle_s goes, never below min_gpus."""
    body = {"name": "k", "cluster_type": "kubernetes", "num_gpus": 0,
            "autoscaling": {"min_gpus": 0, "max_gpus": 24, "idle_s": 30}}  # fmt: skip
    r = await api.client.post(f"{P}/clusters", json=body)
    assert r.status_code == 201, r.text
    await api.wait_cluster("k", {"ready"})
    pods = ScaleSignals(pending_jobs=("default/a", "default/b", "default/c"),
                        pending_gpus=(8, 4, 4), by_pods=True)  # fmt: skip
    layer.always("scale_signals", pods)
    await autoscale_pass(api.runtime)
    await autoscale_pass(api.runtime)  # the nodes join: none more for the same pods
    c = await all_running(api, "k", 2)
    assert c["num_gpus"] == 16
    ups = await events(api, "k", "ScaledUp")
    assert len(ups) == 2 and all("pending pod(s) default/a" in e["message"] for e in ups)
    # The pods ran; nothing pending; the nodes are idle, but not yet for idle_s.
    layer.always("scale_signals", ScaleSignals(by_pods=True))
    await autoscale_pass(api.runtime)
    assert (await get(api, "k"))["num_gpus"] == 16
    # Past idle_s (the clocks moved back), both go: min_gpus is 0.
    from gpuclusters.server.controllers import autoscaler

    for node_id in list(autoscaler._IDLE_SINCE):
        autoscaler._IDLE_SINCE[node_id] -= 31
    await autoscale_pass(api.runtime)
    assert (await get(api, "k"))["num_gpus"] == 0
    downs = await events(api, "k", "ScaledDown")
    assert len(downs) == 2 and all("idle for 30 s" in e["message"] for e in downs)
