"""Phase deadlines and retry backoff: the reconcile engine's pure rules.

Every phase a node or cluster moves through by itself has a deadline: the
longest it may stay there. Past it the row fails with the reason (a node's
repair policy then takes over), or, for the phases that release and delete,
the steps still failing are skipped with an event so that a delete always
finishes (docs/architecture.md, "Outcomes, retries and deadlines").

Settled states (running, failed, deleted; ready, degraded, failed, deleted)
have none. ``queued`` has none: a queued cluster waits for capacity or its
start time because its owner asked for that, and a delete ends it. A
repairing node is owned by its repair, which has its own limit
(``repair_max_wait_s``). 0 in settings turns a deadline off.

A failed attempt is tried again after ``backoff_s(retries)``: doubling from
``base_s`` up to ``cap_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from gpuclusters.core.enums import ClusterStatus, NodePhase

NODE_PHASE_DEADLINES_S: Mapping[str, float] = {
    NodePhase.PENDING.value: 1800.0,  # waiting for a host being released
    NodePhase.SCHEDULING.value: 600.0,  # the provider makes the instance
    NodePhase.BOOTING.value: 900.0,  # the instance boots
    NodePhase.BOOTSTRAPPING.value: 1800.0,  # joins the cluster, acceptance tests
    NodePhase.DRAINING.value: 900.0,  # past the drain timeout (5 min) it releases anyway
    NodePhase.RELEASING.value: 600.0,  # then failing layer/provider steps are skipped
}

CLUSTER_PHASE_DEADLINES_S: Mapping[str, float] = {
    ClusterStatus.WAITING_FOR_BUILD.value: 3600.0,
    ClusterStatus.WAITING_FOR_CONTROL_PLANE.value: 900.0,
    ClusterStatus.WAITING_FOR_VOLUME.value: 600.0,
    ClusterStatus.WAITING_FOR_NODES.value: 3600.0,
    ClusterStatus.RUNNING_ACCEPTANCE_TESTS.value: 1800.0,
    ClusterStatus.DELETING.value: 1800.0,  # then a failing layer delete is skipped
}

# Phases whose deadline ends in "skip what still fails and finish" rather
# than "fail": a release or delete must always finish.
NODE_FINISH_AT_DEADLINE = frozenset({NodePhase.DRAINING.value, NodePhase.RELEASING.value})
CLUSTER_FINISH_AT_DEADLINE = frozenset({ClusterStatus.DELETING.value})


def merged(
    defaults: Mapping[str, float], given: Mapping[str, float], *, kind: str
) -> dict[str, float]:
    """``defaults`` with ``given`` laid over them; a key that is not one of
    the defaults' phases, or a negative value, is an error naming it."""
    for key, value in given.items():
        if key not in defaults:
            raise ValueError(
                f"{kind} deadline for {key!r}: not a phase with a deadline "
                f"(one of {', '.join(sorted(defaults))})"
            )
        if value < 0:
            raise ValueError(f"{kind} deadline for {key!r}: must be >= 0 (0 turns it off)")
    return {**defaults, **given}


def deadline_at(limits: Mapping[str, float], phase: str, since: datetime) -> datetime | None:
    """When a row that entered ``phase`` at ``since`` must have left it."""
    limit = limits.get(phase, 0.0)
    return since + timedelta(seconds=limit) if limit > 0 else None


def backoff_s(retries: int, *, base_s: float, cap_s: float) -> float:
    """Seconds before attempt ``retries + 1`` after ``retries`` failures."""
    if retries <= 0:
        return 0.0
    return min(cap_s, base_s * float(2 ** min(retries - 1, 30)))
