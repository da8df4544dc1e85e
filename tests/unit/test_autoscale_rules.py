"""Autoscaling's pure rules (core/autoscale.py) and Slurm's power saving
configuration (layers/slurm/config.py)."""

from __future__ import annotations

import pytest

from gpuclusters.core.autoscale import (
    ScaleSignals,
    SlotState,
    decide,
    decide_demand,
    free_slots,
    nodes_for,
    slot_names,
)
from gpuclusters.core.errors import ValidationError
from gpuclusters.layers.kubernetes.stack import pod_gpus, unschedulable_gpu_pods
from gpuclusters.layers.slurm import config as cfg


def signals(**kinds: str) -> ScaleSignals:
    return ScaleSignals(
        slots=tuple(
            SlotState(
                name=name.replace("_", "-"),
                wants_up=kind == "up",
                released=kind in ("released", "busy"),
                busy=kind == "busy",
            )
            for name, kind in kinds.items()
        )
    )


def test_slots_and_free_slots() -> None:
    assert slot_names("a", 24) == ("a-as1", "a-as2", "a-as3")
    assert slot_names("a", 0) == ()
    assert free_slots(slot_names("a", 24), ["a-as2", None], 5) == ["a-as1", "a-as3"]


def test_slots_asked_for_get_nodes_up_to_max_and_never_twice() -> None:
    s = signals(a_as1="up", a_as2="up", a_as3="up")
    assert decide(s, {}, min_gpus=0, max_gpus=24).add == ("a-as1", "a-as2", "a-as3")
    # A slot a leaving node still holds is not given a second node.
    held = decide(s, {"a-as1": "n1"}, held={"a-as2"}, min_gpus=0, max_gpus=24)
    assert held.add == ("a-as3",)
    # max bounds it even if the scheduler asked for more.
    assert decide(s, {"a-as1": "n1"}, min_gpus=0, max_gpus=16).add == ("a-as2",)


def test_released_idle_nodes_go_but_not_busy_ones_nor_below_min() -> None:
    s = signals(a_as1="released", a_as2="busy", a_as3="released")
    nodes = {"a-as1": "n1", "a-as2": "n2", "a-as3": "n3"}
    d = decide(s, nodes, min_gpus=0, max_gpus=24)
    assert d.remove == ("n1", "n3") and d.kept == {"n2": "work still runs there"}
    d = decide(s, nodes, min_gpus=0, max_gpus=24, busy_nodes=["n3"])
    assert d.remove == ("n1",) and set(d.kept) == {"n2", "n3"}
    # min_gpus 16: two must stay; n2 is busy (stays anyway), so one of n1/n3 goes.
    d = decide(s, nodes, min_gpus=16, max_gpus=24)
    assert d.remove == ("n1",)
    assert d.kept["n3"] == "the cluster stays at min_gpus (16)"
    # A slot asked up again is not released.
    assert decide(signals(a_as1="up"), {"a-as1": "n1"}, min_gpus=0, max_gpus=8).empty


def spec(**kw: object) -> cfg.SlurmSpec:
    base: dict[str, object] = {
        "cluster_name": "c1",
        "controller_host": "c1-ctl",
        "controller_addr": "10.232.0.10",
    }
    base.update(kw)
    return cfg.SlurmSpec(**base)  # type: ignore[arg-type]


def test_power_saving_lines() -> None:
    cloud = cfg.CloudNodes(
        names=("a-as1", "a-as2", "a-as3"), keep=1, suspend_time_s=120, features=("standard",)
    )
    conf = cfg.render_slurm_conf(spec(cloud=cloud, gpu_type="h100"))
    lines = conf.splitlines()
    for line in (
        "SlurmctldParameters=enable_configless,cloud_reg_addrs",
        "ResumeProgram=/etc/slurm/resume.sh",
        "SuspendProgram=/etc/slurm/suspend.sh",
        "SuspendTime=120",
        "ResumeTimeout=600",
        "SuspendExcNodes=a-as[1-3]:1",
        "PrivateData=cloud",
        "NodeName=a-as[1-3] State=CLOUD Gres=gpu:h100:8 Feature=gpu,h100,standard",
    ):
        assert line in lines, line
    # Without autoscaling nothing of it is there.
    plain = cfg.render_slurm_conf(spec())
    assert "State=CLOUD" not in plain and "SuspendTime" not in plain
    assert "SlurmctldParameters=enable_configless" in plain.splitlines()
    # The user's PrivateData wins; power saving keys are ours.
    own = cfg.render_slurm_conf(spec(cloud=cloud, extra_slurm_conf="PrivateData=jobs"))
    assert "PrivateData=jobs" in own and "PrivateData=cloud" not in own
    for line in ("SuspendTime=5", "ResumeProgram=/bin/true", "SuspendExcNodes=x"):
        with pytest.raises(ValidationError, match=line.split("=")[0]):
            cfg.validate_extra_slurm_conf(line)
    scripts = cfg.controller_scripts(spec(cloud=cloud))
    assert set(scripts) == {"/etc/slurm/resume.sh", "/etc/slurm/suspend.sh"}
    assert scripts["/etc/slurm/resume.sh"].startswith("#!/bin/sh\n")
    assert cfg.controller_scripts(spec()) == {}


def test_slot_slurmd_runs_with_a_fresh_boot_clock() -> None:
    argv = cfg.slurmd_argv(spec(), node_name="n1", slot="a-as2")
    assert argv[:2] == ["sh", "-c"]
    assert "unshare --time --boottime" in argv[2]
    assert argv[2].endswith("slurmd -D -N a-as2 --conf-server 10.232.0.10:6817")
    assert "-Z" in cfg.slurmd_argv(spec(), node_name="n1")


def test_hostlist() -> None:
    assert cfg.hostlist(["a-as1", "a-as2", "a-as3"]) == "a-as[1-3]"
    assert cfg.hostlist(["a-as1"]) == "a-as1"
    assert cfg.hostlist(["a-as1", "a-as3"]) == "a-as1,a-as3"


def test_nodes_for_pending_pods() -> None:
    assert nodes_for([]) == 0
    assert nodes_for([8, 8]) == 2
    assert nodes_for([4, 4, 2, 2]) == 2
    assert nodes_for([4, 4]) == 1
    assert nodes_for([6, 4, 2]) == 2  # 6+2, 4
    assert nodes_for([16, 1]) == 1  # a pod asking more than a node fits nowhere


def test_decide_demand() -> None:
    free = ["k-as1", "k-as2", "k-as3"]
    d = decide_demand(pending_gpus=[8, 8], joining=0, live=0, free=free, idle_for={},
                      idle_s=30, min_gpus=0, max_gpus=24)  # fmt: skip
    assert d.add == ("k-as1", "k-as2")
    # Nodes already joining for them: none more.
    d = decide_demand(pending_gpus=[8, 8], joining=2, live=2, free=free[2:], idle_for={},
                      idle_s=30, min_gpus=0, max_gpus=24)  # fmt: skip
    assert d.empty
    # max bounds it.
    d = decide_demand(pending_gpus=[8] * 5, joining=0, live=1, free=free[1:], idle_for={},
                      idle_s=30, min_gpus=0, max_gpus=24)  # fmt: skip
    assert d.add == ("k-as2", "k-as3")
    # Idle long enough goes, longest first, down to min; not while pods wait.
    idle = {"n1": 40.0, "n2": 100.0, "n3": 10.0}
    d = decide_demand(pending_gpus=[], joining=0, live=3, free=[], idle_for=idle,
                      idle_s=30, min_gpus=16, max_gpus=24)  # fmt: skip
    assert d.remove == ("n2",) and not d.kept
    assert "idle for 30 s" in d.why_removed["n2"]
    d = decide_demand(pending_gpus=[8], joining=1, live=3, free=[], idle_for=idle,
                      idle_s=30, min_gpus=0, max_gpus=24)  # fmt: skip
    assert d.empty


def test_unschedulable_gpu_pods() -> None:
    def pod(name: str, gpus: int | None, *, reason: str = "Unschedulable",
            node: str | None = None, init: int = 0) -> dict[str, object]:  # fmt: skip
        res = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus is not None else {}
        spec: dict[str, object] = {"containers": [{"name": "c", "resources": res}]}
        if init:
            spec["initContainers"] = [
                {"name": "i", "resources": {"requests": {"nvidia.com/gpu": init}}}
            ]
        if node:
            spec["nodeName"] = node
        return {
            "metadata": {"name": name, "namespace": "ml", "creationTimestamp": name},
            "spec": spec,
            "status": {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": reason}],
            },
        }

    pods = [
        pod("a", 8),
        pod("b", None),  # no GPU
        pod("c", 4, reason="SchedulerError"),
        pod("d", 2, node="n1"),  # bound, pulling its image
        pod("e", 1, init=4),
    ]
    assert unschedulable_gpu_pods(pods) == [("ml/a", 8), ("ml/e", 4)]  # type: ignore[arg-type]
    assert pod_gpus(pod("x", 3)) == 3  # type: ignore[arg-type]
