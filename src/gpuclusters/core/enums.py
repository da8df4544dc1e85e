"""Enumerations of the public API. Values are the wire strings."""

from __future__ import annotations

from enum import StrEnum


class ClusterType(StrEnum):
    KUBERNETES = "kubernetes"
    SLURM = "slurm"


class BillingType(StrEnum):
    RESERVED = "reserved"
    ON_DEMAND = "on_demand"
    SCHEDULED_CAPACITY = "scheduled_capacity"


class ClusterStatus(StrEnum):
    """Cluster state machine (see docs/architecture.md).

    queued -> waiting_for_control_plane -> waiting_for_volume -> waiting_for_nodes
    -> running_acceptance_tests -> ready <-> degraded; any -> deleting -> deleted;
    failed when the cluster cannot become ready. waiting_for_control_plane <->
    waiting_for_build while a part the control plane runs is still being
    built by scripts/setup's background builder (core/builds.py). ready ->
    suspended -> queued when a project's budget stops it and credit returns.
    """

    QUEUED = "queued"
    WAITING_FOR_BUILD = "waiting_for_build"
    WAITING_FOR_CONTROL_PLANE = "waiting_for_control_plane"
    WAITING_FOR_VOLUME = "waiting_for_volume"
    WAITING_FOR_NODES = "waiting_for_nodes"
    RUNNING_ACCEPTANCE_TESTS = "running_acceptance_tests"
    READY = "ready"
    DEGRADED = "degraded"
    PAUSED = "paused"
    # The project's budget ran out under the ``stop`` policy: its nodes are
    # released, volume and control plane kept; it resumes when credit
    # returns (docs/budgets.md).
    SUSPENDED = "suspended"
    FAILED = "failed"
    DELETING = "deleting"
    DELETED = "deleted"


class NodePhase(StrEnum):
    """Node state machine.

    pending -> scheduling -> booting -> bootstrapping -> running;
    running/any -> draining -> releasing -> deleted; failed on a permanent error;
    running -> repairing -> bootstrapping (reboot, reprovision) or scheduling
    (migrate to a new host) while a repair works on the node.
    """

    PENDING = "pending"
    SCHEDULING = "scheduling"
    BOOTING = "booting"
    BOOTSTRAPPING = "bootstrapping"
    RUNNING = "running"
    REPAIRING = "repairing"
    DRAINING = "draining"
    RELEASING = "releasing"
    DELETED = "deleted"
    FAILED = "failed"


class ComputeClass(StrEnum):
    STANDARD = "standard"
    PREEMPTIBLE = "preemptible"


class VolumeStatus(StrEnum):
    PROVISIONING = "provisioning"
    AVAILABLE = "available"
    BOUND = "bound"
    DELETING = "deleting"
    DELETED = "deleted"


class ProjectRole(StrEnum):
    """Project roles (contract section 9): admins create, scale and delete;
    editors use what exists (read, SSH, kubectl, jobs, volume data)."""

    ADMIN = "admin"
    EDITOR = "editor"


class CapacityKind(StrEnum):
    """Capacity set aside for a project (contract section 8)."""

    RESERVED = "reserved"  # prepaid for a period
    POOL = "pool"  # pre-arranged, drawn for scheduled windows


class HostState(StrEnum):
    AVAILABLE = "available"
    CORDONED = "cordoned"


class HostAgentStatus(StrEnum):
    """A host agent's connection (hosts with agents only; docs/hosts.md)."""

    JOINING = "joining"
    READY = "ready"
    UNREACHABLE = "unreachable"
    REMOVED = "removed"


class EventReason(StrEnum):
    """Node lifecycle event reasons (contract section 1)."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    NODE_ADDED = "NodeAdded"
    NODE_FAILED = "NodeFailed"
    PREEMPTION_NOTIFIED = "PreemptionNotified"
    PREEMPTED = "Preempted"
    RESERVATION_ENDING = "ReservationEnding"
    # A release or delete step that could not work was skipped (the layer
    # never came up, the host is gone, the deadline passed, or forced).
    STEP_SKIPPED = "StepSkipped"
    HOST_CORDONED = "HostCordoned"
    # Autoscaling (docs/autoscaling.md): a node the scheduler asked for
    # that quotas, the budget or capacity refused; a released node kept.
    SCALE_UP_BLOCKED = "ScaleUpBlocked"
    SCALE_DOWN_DEFERRED = "ScaleDownDeferred"


GPUS_PER_NODE = 8
