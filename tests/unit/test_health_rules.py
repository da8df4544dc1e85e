"""Pure health logic: findings from GPU and node state, repair rules,
escalation and the approval policy."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuclusters.core.health.findings import (
    AlertKind,
    GpuHealth,
    NodeState,
    alert_key,
    gpu_findings,
    node_findings,
)
from gpuclusters.core.health.rules import (
    SETTLE_WINDOW,
    Decision,
    PastRepair,
    Policy,
    RepairAction,
    Verdict,
    WaitingRepair,
    blocked_reason,
    decide_automatic,
    needs_approval,
    paused_reason,
    recommend,
    unhealthy_limit,
)

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def test_gpu_findings_cover_each_fault() -> None:
    gpus = [
        GpuHealth(0),
        GpuHealth(1, xids=(79,)),
        GpuHealth(2, xids=(13,)),
        GpuHealth(3, ecc_dbe=2),
        GpuHealth(4, row_remap_failure=True),
        GpuHealth(5, thermal_throttle=True),
        GpuHealth(6, pcie_replays_per_min=500),
        GpuHealth(7, present=False),
    ]
    found = {(f.kind, f.gpu): f for f in gpu_findings(gpus, expected=8)}
    assert found[("gpu_missing", 1)].severity == "critical" and found[("gpu_missing", 1)].code == 79
    assert found[("xid", 2)].severity == "warning"  # Xid 13 is an application error
    assert found[("ecc_dbe", 3)].severity == "critical"
    assert found[("row_remap_failure", 4)].severity == "critical"
    assert found[("thermal_throttle", 5)].severity == "warning"
    assert found[("pcie_replay", 6)].severity == "warning"
    assert found[("gpu_missing", 7)].severity == "critical"
    assert ("xid", 0) not in found and len(found) == 7
    # Fewer GPUs listed than the node should have: one count-mismatch alert.
    (missing,) = gpu_findings([GpuHealth(i) for i in range(6)], expected=8)
    assert missing.kind == "gpu_missing" and "6 of 8" in missing.message


def test_node_findings() -> None:
    assert node_findings(NodeState()) == []
    found = node_findings(
        NodeState(
            scratch_writable=False,
            disk_free_fraction=0.01,
            memory_available_fraction=0.02,
            pids_free_fraction=0.5,
            daemon_restarts={"slurmd": 4, "kubelet": 1},
            ib_ports={"mlx5_0/1": ("DOWN", 1), "mlx5_1/1": ("ACTIVE", 5)},
        )
    )
    kinds = [f.kind for f in found]
    assert kinds == [
        "fs_readonly",
        "disk_pressure",
        "memory_pressure",
        "daemon_restart_loop",
        "ib_port_down",
        "ib_port_flap",
    ]
    assert alert_key(found[3]) == ("daemon_restart_loop", None, "slurmd")
    assert alert_key(found[3].to_dict()) == alert_key(found[3])


def test_rules_map_faults_to_actions() -> None:
    assert recommend(["gpu_missing"], now=NOW) is RepairAction.MIGRATE
    assert recommend(["ecc_dbe"], now=NOW) is RepairAction.REBOOT
    assert recommend(["fs_readonly"], now=NOW) is RepairAction.REPROVISION
    assert recommend(["disk_pressure"], now=NOW) is RepairAction.WARN
    assert recommend(["ecc_dbe", "fs_readonly"], now=NOW) is RepairAction.REPROVISION


def test_escalation_reboot_then_reprovision_then_migrate() -> None:
    def past(action: RepairAction, hours_ago: float) -> PastRepair:
        return PastRepair(action, frozenset({AlertKind.ECC_DBE}), NOW - timedelta(hours=hours_ago),
                          True)  # fmt: skip

    assert recommend(["ecc_dbe"], history=[past(RepairAction.REBOOT, 1)], now=NOW) is (
        RepairAction.REPROVISION
    )
    assert recommend(["ecc_dbe"], history=[past(RepairAction.REPROVISION, 1)], now=NOW) is (
        RepairAction.MIGRATE
    )
    assert recommend(["ecc_dbe"], history=[past(RepairAction.MIGRATE, 1)], now=NOW) is (
        RepairAction.MIGRATE
    )
    # Long ago, or another fault: no escalation.
    assert recommend(["ecc_dbe"], history=[past(RepairAction.REBOOT, 48)], now=NOW) is (
        RepairAction.REBOOT
    )
    assert recommend(["thermal_throttle"], history=[past(RepairAction.REBOOT, 1)], now=NOW) is (
        RepairAction.MIGRATE
    )


def test_policy_approval_rules() -> None:
    auto = Policy(automatic=frozenset({"*"}))
    base = {"node_auto_repair": True, "unhealthy_nodes": 1, "cluster_nodes": 5,
            "last_repair_at": None, "now": NOW}  # fmt: skip
    assert needs_approval(Policy(), ["ecc_dbe"], **base)[0] is True
    assert needs_approval(auto, ["ecc_dbe"], **base) == (False, "")
    only_ecc = Policy(automatic=frozenset({"ecc_dbe"}))
    assert needs_approval(only_ecc, ["ecc_dbe"], **base)[0] is False
    assert needs_approval(only_ecc, ["ecc_dbe", "xid"], **base)[0] is True
    off = base | {"node_auto_repair": False}
    assert "auto-repair is off" in needs_approval(auto, ["ecc_dbe"], **off)[1]
    sick = base | {"unhealthy_nodes": 2}
    assert "paused" in needs_approval(auto, ["ecc_dbe"], **sick)[1]
    recent = base | {"last_repair_at": NOW - timedelta(minutes=5)}
    assert "cooldown" in needs_approval(auto, ["ecc_dbe"], **recent)[1]


def test_unhealthy_limit_is_a_fifth_but_at_least_one_node() -> None:
    assert [unhealthy_limit(n) for n in (1, 2, 4, 5, 9, 10, 14, 15, 100)] == [
        1, 1, 1, 1, 1, 2, 2, 3, 20
    ]  # fmt: skip
    assert paused_reason(1, 2) == "" and paused_reason(2, 10) == ""
    assert paused_reason(2, 2) == (
        "2 of 2 nodes are unhealthy (more than 20%): automatic repair is paused"
    )
    assert "3 of 10" in paused_reason(3, 10)


def test_blocked_reason_is_the_nodes_own_and_needs_approval_adds_the_limit() -> None:
    auto = Policy(automatic=frozenset({"ecc_dbe"}))
    own: dict[str, Any] = {"node_auto_repair": True, "last_repair_at": None, "now": NOW}
    assert blocked_reason(auto, ["ecc_dbe"], **own) == ""
    assert "policy" in blocked_reason(auto, ["xid"], **own)
    assert "cooldown" in blocked_reason(
        auto, ["ecc_dbe"], **own | {"last_repair_at": NOW - timedelta(minutes=1)}
    )
    # The node's own reason comes first; then the cluster's limit.
    both = needs_approval(auto, ["xid"], **own, unhealthy_nodes=2, cluster_nodes=2)
    assert both == (True, "the cluster's policy asks for approval")
    assert "paused" in needs_approval(auto, ["ecc_dbe"], **own, unhealthy_nodes=2,
                                      cluster_nodes=2)[1]  # fmt: skip


def waiting(node: str, seconds_ago: float, blocked: str = "") -> WaitingRepair:
    return WaitingRepair(node, NOW - timedelta(seconds=seconds_ago), blocked)


def test_automatic_repairs_settle_before_they_start() -> None:
    settled = SETTLE_WINDOW.total_seconds()
    # One unhealthy node of two: within the limit; it starts once settled.
    assert decide_automatic([waiting("a", 1)], unhealthy_nodes=1, cluster_nodes=2, now=NOW) == [
        Decision("a", Verdict.WAIT)
    ]
    assert decide_automatic(
        [waiting("a", settled)], unhealthy_nodes=1, cluster_nodes=2, now=NOW
    ) == [Decision("a", Verdict.START)]
    # A node's own reason holds it whatever the count.
    assert decide_automatic(
        [waiting("a", settled, "auto-repair is off for this node")],
        unhealthy_nodes=1,
        cluster_nodes=2,
        now=NOW,
    ) == [Decision("a", Verdict.HOLD, "auto-repair is off for this node")]


def test_faults_together_above_the_limit_all_wait_for_a_person_in_any_order() -> None:
    """The flaky e2e's case: two of two nodes report an ECC error a few
    seconds apart. Whichever arrived (or settled) first, neither starts."""
    paused = "2 of 2 nodes are unhealthy (more than 20%): automatic repair is paused"
    expected = [Decision("a", Verdict.HOLD, paused), Decision("b", Verdict.HOLD, paused)]
    for ages in [(0, 3), (3, 0), (0, 0), (SETTLE_WINDOW.total_seconds(), 1)]:
        repairs = [waiting("a", ages[0]), waiting("b", ages[1])]
        for order in itertools.permutations(repairs):
            assert decide_automatic(order, unhealthy_nodes=2, cluster_nodes=2, now=NOW) == (
                expected
            )
    # Seen one at a time, as the repair reconciler sees them: the same answer.
    for w in (waiting("a", 30), waiting("b", 0)):
        (d,) = decide_automatic([w], unhealthy_nodes=2, cluster_nodes=2, now=NOW)
        assert d.verdict is Verdict.HOLD and d.reason == paused


def test_within_the_limit_every_settled_repair_starts() -> None:
    # Ten nodes, two unhealthy at once: 20% is allowed; both start, none
    # is favoured by its name or its arrival.
    repairs = [waiting("n7", 25), waiting("n2", 21)]
    for order in itertools.permutations(repairs):
        assert decide_automatic(order, unhealthy_nodes=2, cluster_nodes=10, now=NOW) == [
            Decision("n2", Verdict.START),
            Decision("n7", Verdict.START),
        ]
    # A third one: 30% of the cluster. Nothing that has not started starts.
    three = [*repairs, waiting("n5", 1)]
    assert {d.verdict for d in decide_automatic(
        three, unhealthy_nodes=3, cluster_nodes=10, now=NOW)} == {Verdict.HOLD}  # fmt: skip
