"""A cluster whose control plane needs something scripts/setup still builds
in the background waits in ``waiting_for_build``, says what for, and goes
on by itself once it is built; nothing of the control plane starts before.

The layer's side (which add-ons, read from the builder's status file) is
``test_kubernetes_layer_waits_for_the_background_builder`` below, against
the real ``KubernetesLayer`` and a real status file."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gpuclusters.builds import status as build_status
from gpuclusters.core.builds import BACKGROUND_PLAN, BuildStatus, StepState
from gpuclusters.core.enums import ClusterType
from gpuclusters.layers.base import ClusterRef
from gpuclusters.layers.kubernetes.layer import KubernetesLayer
from gpuclusters.layers.noop.layer import NoopLayer
from support.api import ApiHarness

P = "/v1/projects/default"


@dataclass
class BuildGatedLayer(NoopLayer):
    waiting: str | None = "waiting for coredns: built in the background by scripts/setup"
    control_planes: list[str] = field(default_factory=list)

    def waiting_for_builds(self) -> str | None:
        return self.waiting

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        self.control_planes.append(cluster.name)
        return True


async def test_a_cluster_waits_for_the_build_then_becomes_ready(api: ApiHarness) -> None:
    layer = BuildGatedLayer()
    api.runtime.layers[ClusterType.KUBERNETES] = layer
    r = await api.client.post(
        f"{P}/clusters", json={"name": "k1", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text

    waiting = await api.wait_cluster("k1", {"waiting_for_build", "ready", "failed"})
    assert waiting["status"] == "waiting_for_build"
    assert waiting["status_message"] == layer.waiting
    # Several passes of the cluster reconciler later (its step counter),
    # still waiting, and no control plane was started.
    start = _cluster_steps()
    while _cluster_steps() < start + 3:  # noqa: ASYNC110 (a counter, not an event)
        await asyncio.sleep(0.05)
    again = (await api.client.get(f"{P}/clusters/k1")).json()
    assert again["status"] == "waiting_for_build"
    assert layer.control_planes == []

    layer.waiting = None  # the builder finished
    ready = await api.wait_cluster("k1", {"ready", "failed"})
    assert ready["status"] == "ready"
    assert layer.control_planes == ["k1"]
    phases = [p["phase"] for p in ready["phase_history"]]
    i = phases.index("waiting_for_build")
    assert phases[i - 1 : i + 2] == [
        "waiting_for_control_plane",
        "waiting_for_build",
        "waiting_for_control_plane",
    ]


def _cluster_steps() -> float:
    return (
        REGISTRY.get_sample_value(
            "gpuclusters_reconcile_steps_total", {"controller": "clusters", "result": "ok"}
        )
        or 0.0
    )


def _status(directory: Path, states: dict[str, StepState], *, pid: int) -> None:
    status = BuildStatus.fresh(BACKGROUND_PLAN, pid=pid, now=0.0, log_dir=str(directory / "logs"))
    for name, state in states.items():
        status.step(name).state = state
    directory.mkdir(parents=True, exist_ok=True)
    build_status.write(status, directory)


def test_kubernetes_layer_waits_for_the_background_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds, addons = tmp_path / "builds", tmp_path / "addons"
    addons.mkdir()
    monkeypatch.setenv(build_status.DIR_ENV, str(builds))
    layer = KubernetesLayer(access=None, addons_bin_dir=addons)  # type: ignore[arg-type]

    # No builder ever ran: a missing add-on is left out, as before.
    assert layer.waiting_for_builds() is None

    # A live builder (this process) with CoreDNS building, metrics-server pending.
    _status(builds, {"coredns": StepState.BUILDING}, pid=os.getpid())
    message = layer.waiting_for_builds()
    assert message is not None
    assert message.startswith("waiting for coredns, metrics-server:")
    assert str(builds / "logs" / "coredns.log") in message

    # CoreDNS is there: only metrics-server is waited for.
    (addons / "coredns").write_bytes(b"")
    _status(builds, {"coredns": StepState.DONE}, pid=os.getpid())
    assert (layer.waiting_for_builds() or "").startswith("waiting for metrics-server:")

    # A failed step is not waited for (the cluster goes on without it).
    _status(
        builds, {"coredns": StepState.DONE, "metrics-server": StepState.FAILED}, pid=os.getpid()
    )
    assert layer.waiting_for_builds() is None

    # A builder that is gone (killed, rebooted) builds nothing: no wait.
    _status(builds, {"coredns": StepState.DONE}, pid=2**22 + 1)
    assert layer.waiting_for_builds() is None
