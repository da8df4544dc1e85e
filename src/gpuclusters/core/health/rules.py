"""Repair rules (contract section 7): which action an alert calls for, how
actions escalate, and whether a repair may run without a human.

Actions, mildest first: ``reboot`` (keeps local scratch) -> ``reprovision``
(rebuilt on the same host, scratch wiped) -> ``migrate`` (a new host; the old
one is cordoned) ; ``remove`` (no replacement, for hardware return) is only
ever asked for by a person. ``warn`` means no repair.

Escalation: when the same kind of fault comes back on a node within the
escalation window after a repair, the next repair is one step stronger than
both the rule's action and the last one taken.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from gpuclusters.core.health.findings import AlertKind


class RepairAction(StrEnum):
    WARN = "warn"
    REBOOT = "reboot"
    REPROVISION = "reprovision"
    MIGRATE = "migrate"
    REMOVE = "remove"


LADDER = (RepairAction.REBOOT, RepairAction.REPROVISION, RepairAction.MIGRATE)

ACTION_FOR: dict[str, RepairAction] = {
    AlertKind.GPU_MISSING: RepairAction.MIGRATE,
    AlertKind.THERMAL_THROTTLE: RepairAction.MIGRATE,
    AlertKind.PCIE_REPLAY: RepairAction.MIGRATE,
    AlertKind.IB_PORT_DOWN: RepairAction.MIGRATE,
    AlertKind.IB_PORT_FLAP: RepairAction.MIGRATE,
    AlertKind.FS_READONLY: RepairAction.REPROVISION,
    AlertKind.XID: RepairAction.REBOOT,
    AlertKind.ECC_DBE: RepairAction.REBOOT,
    AlertKind.ROW_REMAP_FAILURE: RepairAction.REBOOT,
    AlertKind.MEMORY_PRESSURE: RepairAction.REBOOT,
    AlertKind.DAEMON_RESTART_LOOP: RepairAction.REBOOT,
    # A node that stopped answering: reboot it (with approval by default);
    # never removed on an unknown state (fail closed).
    AlertKind.HEARTBEAT_MISSED: RepairAction.REBOOT,
    AlertKind.DISK_PRESSURE: RepairAction.WARN,
    AlertKind.PID_PRESSURE: RepairAction.WARN,
}

ESCALATION_WINDOW = timedelta(hours=24)
COOLDOWN = timedelta(minutes=30)
MAX_UNHEALTHY_FRACTION = 0.2


def stronger(a: RepairAction, b: RepairAction) -> RepairAction:
    if a not in LADDER:
        return b
    if b not in LADDER:
        return a
    return max(a, b, key=LADDER.index)


def next_step(a: RepairAction) -> RepairAction:
    if a not in LADDER:
        return a
    return LADDER[min(LADDER.index(a) + 1, len(LADDER) - 1)]


@dataclass(frozen=True, slots=True)
class PastRepair:
    action: RepairAction
    kinds: frozenset[str]
    finished_at: datetime
    succeeded: bool


def recommend(
    kinds: Iterable[str],
    *,
    severities: Iterable[str] = (),
    history: Iterable[PastRepair] = (),
    now: datetime,
    window: timedelta = ESCALATION_WINDOW,
) -> RepairAction:
    """The action for a node's open alerts: the strongest rule action among
    them, escalated past any repair of the same kinds within ``window``."""
    kinds = set(kinds)
    action = RepairAction.WARN
    for kind in kinds:
        action = stronger(action, ACTION_FOR.get(kind, RepairAction.WARN))
    if action is RepairAction.WARN:
        return action
    for past in history:
        if past.kinds & kinds and now - past.finished_at <= window:
            action = stronger(action, next_step(past.action))
    return action


@dataclass(frozen=True, slots=True)
class Policy:
    """A cluster's repair policy. ``automatic`` faults (alert kinds, or
    ``"*"`` for all) are repaired without approval; every other repair waits
    for a person."""

    automatic: frozenset[str] = frozenset()

    def is_automatic(self, kinds: Iterable[str]) -> bool:
        kinds = set(kinds)
        return bool(kinds) and ("*" in self.automatic or kinds <= self.automatic)


def needs_approval(
    policy: Policy,
    kinds: Iterable[str],
    *,
    node_auto_repair: bool,
    unhealthy_nodes: int,
    cluster_nodes: int,
    last_repair_at: datetime | None,
    now: datetime,
    cooldown: timedelta = COOLDOWN,
) -> tuple[bool, str]:
    """Whether a repair must wait for approval, and why (empty when not)."""
    if not policy.is_automatic(kinds):
        return True, "the cluster's policy asks for approval"
    if not node_auto_repair:
        return True, "auto-repair is off for this node"
    # More than 20% unhealthy smells of a shared cause (a bad rack, a
    # switch, our own bug): stop acting alone. One node at a time is always
    # allowed, or no cluster under five nodes could ever repair itself.
    limit = max(1, int(cluster_nodes * MAX_UNHEALTHY_FRACTION))
    if unhealthy_nodes > limit:
        return True, (
            f"{unhealthy_nodes} of {cluster_nodes} nodes are unhealthy (more than "
            f"{MAX_UNHEALTHY_FRACTION:.0%}): automatic repair is paused"
        )
    if last_repair_at is not None and now - last_repair_at < cooldown:
        return True, f"the node was repaired less than {cooldown} ago (cooldown)"
    return False, ""
