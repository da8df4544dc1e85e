"""Repair rules (contract section 7): which action an alert calls for, how
actions escalate, and whether a repair may run without a human.

Actions, mildest first: ``reboot`` (keeps local scratch) -> ``reprovision``
(rebuilt on the same host, scratch wiped) -> ``migrate`` (a new host; the old
one is cordoned) ; ``remove`` (no replacement, for hardware return) is only
ever asked for by a person. ``warn`` means no repair.

Escalation: when the same kind of fault comes back on a node within the
escalation window after a repair, the next repair is one step stronger than
both the rule's action and the last one taken.

The unhealthy limit is decided per cluster, over the set of its unhealthy
nodes, never per node in the order their reports happen to arrive: an
automatic repair waits ``SETTLE_WINDOW`` after it was recommended before it
starts, and starts only if the cluster as a whole is then within the limit
(``decide_automatic``). Faults that arrive together above the limit are all
left to a person; none is picked to go first.
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
# How long an automatic repair waits, after it was recommended, for the
# cluster's other nodes to report before it starts: four heartbeat intervals
# of the agent (5 s), so a fault that happened at the same time on another
# node has been reported even past a slow heartbeat or two, and the two are
# decided together (``decide_automatic``). Short next to any repair (a reboot
# takes minutes), and long enough to tell "together" from "one after another".
SETTLE_WINDOW = timedelta(seconds=20)


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


def unhealthy_limit(cluster_nodes: int) -> int:
    """How many unhealthy nodes a cluster may have and still repair itself
    without a person: 20%, and at least one (or no cluster under five nodes
    could ever repair itself)."""
    return max(1, int(cluster_nodes * MAX_UNHEALTHY_FRACTION))


def paused_reason(unhealthy_nodes: int, cluster_nodes: int) -> str:
    """Why automatic repair is paused in the cluster ("" when it is not).

    More than 20% unhealthy smells of a shared cause (a bad rack, a switch,
    a cooling fault, our own bug): acting alone would reboot or migrate nodes
    that are fine once the cause is fixed, and could take a large share of
    the cluster away at once. A person looks first."""
    if unhealthy_nodes <= unhealthy_limit(cluster_nodes):
        return ""
    return (
        f"{unhealthy_nodes} of {cluster_nodes} nodes are unhealthy (more than "
        f"{MAX_UNHEALTHY_FRACTION:.0%}): automatic repair is paused"
    )


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
    """Whether a repair must wait for approval, and why (empty when not):
    the node's own reasons (``blocked_reason``) first, then the cluster's
    unhealthy limit. ``unhealthy_nodes`` counts the cluster's unhealthy
    nodes, this one included."""
    why = blocked_reason(
        policy,
        kinds,
        node_auto_repair=node_auto_repair,
        last_repair_at=last_repair_at,
        now=now,
        cooldown=cooldown,
    ) or paused_reason(unhealthy_nodes, cluster_nodes)
    return bool(why), why


def blocked_reason(
    policy: Policy,
    kinds: Iterable[str],
    *,
    node_auto_repair: bool,
    last_repair_at: datetime | None,
    now: datetime,
    cooldown: timedelta = COOLDOWN,
) -> str:
    """The node's own reason to ask a person, whatever the rest of the
    cluster looks like ("" when there is none): the cluster's policy does not
    name these faults, the node's auto-repair switch is off, or the node is
    in its cooldown after a repair."""
    if not policy.is_automatic(kinds):
        return "the cluster's policy asks for approval"
    if not node_auto_repair:
        return "auto-repair is off for this node"
    if last_repair_at is not None and now - last_repair_at < cooldown:
        return f"the node was repaired less than {cooldown} ago (cooldown)"
    return ""


class Verdict(StrEnum):
    """What becomes of an automatic repair that has not started yet."""

    WAIT = "wait"  # still settling: other nodes' reports may be on their way
    START = "start"  # no person needed: start it
    HOLD = "hold"  # ask a person (it becomes ``pending_approval``)


@dataclass(frozen=True, slots=True)
class WaitingRepair:
    """An automatic repair recommended for ``node`` that has not started.
    ``blocked`` is the node's own reason to ask a person now, if any (the
    policy, its auto-repair switch, its cooldown: ``needs_approval``)."""

    node: str
    recommended_at: datetime
    blocked: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    node: str
    verdict: Verdict
    reason: str = ""


def decide_automatic(
    waiting: Iterable[WaitingRepair],
    *,
    unhealthy_nodes: int,
    cluster_nodes: int,
    now: datetime,
    settle: timedelta = SETTLE_WINDOW,
) -> list[Decision]:
    """Decide a cluster's automatic repairs that have not started, together.

    The rule: if the cluster as a whole has more unhealthy nodes than the
    limit, every one of them waits for a person (``HOLD``); none is picked to
    go first, because which one arrived first says nothing about which one
    is safe to repair alone. Otherwise each starts once it has settled
    (``settle`` after it was recommended), so faults that arrive together
    (within ``settle``) are judged as a set; a fault that arrives after a
    repair already started is judged with that repair's node still unhealthy.
    A repair the node's own rules block (``blocked``) is held whatever the
    count.

    The outcome depends only on the set of waiting repairs and the count,
    never on the order they are given in (the answer is sorted by node).
    ``unhealthy_nodes`` is the number of the cluster's nodes with an open
    critical alert, the waiting ones included."""
    paused = paused_reason(unhealthy_nodes, cluster_nodes)
    out = []
    for w in sorted(waiting, key=lambda w: (w.node, w.recommended_at)):
        if w.blocked:
            out.append(Decision(w.node, Verdict.HOLD, w.blocked))
        elif paused:
            out.append(Decision(w.node, Verdict.HOLD, paused))
        elif now - w.recommended_at < settle:
            out.append(Decision(w.node, Verdict.WAIT))
        else:
            out.append(Decision(w.node, Verdict.START))
    return out
