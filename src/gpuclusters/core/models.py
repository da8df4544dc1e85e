"""Public API models (``/v1``), shared by the server and the typed client.

Request models validate their own input and say which rule failed; the server
turns a failed validation into ``{code: invalid_input, message, field}``.
Response models are what ``--output json`` prints.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuclusters.core.enums import (
    GPUS_PER_NODE,
    BillingType,
    CapacityKind,
    ClusterStatus,
    ClusterType,
    ComputeClass,
    HostAgentStatus,
    HostState,
    NodePhase,
    ProjectRole,
    VolumeStatus,
)
from gpuclusters.core.health.catalog import ACTIVE_CHECKS, FAULT_KINDS

API_VERSION = "v1"

_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")
NAME_RULE = (
    "must be 1-40 characters of lowercase letters, digits and '-', "
    "start with a letter and not end with '-'"
)


def check_name(value: str) -> str:
    """Names become hostnames and Kubernetes/Slurm identifiers: DNS labels."""
    if not _NAME_RE.match(value):
        raise ValueError(NAME_RULE)
    return value


MAX_GPUS = GPUS_PER_NODE * 10_000
"""The most GPUs one request may name (10,000 nodes: a whole large fleet)."""


def check_gpu_count(value: int, *, minimum: int) -> int:
    if value < minimum:
        raise ValueError(f"must be at least {minimum}, got {value}")
    if value > MAX_GPUS:
        raise ValueError(f"must be at most {MAX_GPUS}, got {value}")
    if value % GPUS_PER_NODE:
        raise ValueError(
            f"must be a multiple of {GPUS_PER_NODE} (one node = {GPUS_PER_NODE} GPUs), got {value}"
        )
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# The schema states the rules the validators enforce (the validators keep
# their own, clearer messages): the OpenAPI document says what is accepted.
Name = Annotated[
    str, Field(min_length=1, max_length=40, json_schema_extra={"pattern": _NAME_RE.pattern})
]
GpuCount = Annotated[
    int,
    Field(
        json_schema_extra={
            "minimum": GPUS_PER_NODE,
            "maximum": MAX_GPUS,
            "multipleOf": GPUS_PER_NODE,
        }
    ),
]
"""A cluster's or reservation's GPUs: whole nodes, at least one."""
OptionalGpuCount = Annotated[
    int, Field(json_schema_extra={"minimum": 0, "maximum": MAX_GPUS, "multipleOf": GPUS_PER_NODE})
]
"""Preemptible GPUs: whole nodes, possibly none."""
MAX_VOLUME_TIB = 100_000


def check_size_tib(value: int) -> int:
    if not 1 <= value <= MAX_VOLUME_TIB:
        raise ValueError(
            f"must be a whole number of TiB, at least 1 and at most {MAX_VOLUME_TIB}, got {value}"
        )
    return value


SizeTib = Annotated[int, Field(json_schema_extra={"minimum": 1, "maximum": MAX_VOLUME_TIB})]


# --- errors -------------------------------------------------------------------


class ErrorBody(_Out):
    code: str
    message: str
    field: str | None = None


# --- catalog ------------------------------------------------------------------


class GpuType(_Out):
    name: str
    memory_gib: int
    gpus_per_node: int = GPUS_PER_NODE
    total_hosts: int
    free_hosts: int


class Region(_Out):
    name: str
    gpu_types: list[str]
    total_hosts: int


class Host(_Out):
    name: str
    region: str
    gpu_type: str
    num_gpus: int
    nvme_gib: int
    ib_island: str
    state: HostState
    node: str | None = None
    cluster: str | None = None
    compute_class: ComputeClass | None = None
    node_phase: str | None = None
    # Hosts with a host agent (docs/hosts.md); None for fleet-file hosts.
    agent_status: HostAgentStatus | None = None
    address: str | None = None
    last_heartbeat_at: datetime | None = None
    inventory: dict[str, Any] | None = None


_DNS_NAME_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)
_HOST_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
HOST_NAME_RULE = "must be 1-63 characters of lowercase letters, digits, '.' and '-'"


def check_host_name(value: str) -> str:
    if not _HOST_NAME_RE.match(value):
        raise ValueError(HOST_NAME_RULE)
    return value


HostName = Annotated[
    str, Field(min_length=1, max_length=63, json_schema_extra={"pattern": _HOST_NAME_RE.pattern})
]


class HostJoinTokenCreate(_Model):
    """``POST /v1/hosts/join-tokens``: let a host agent join as ``name``."""

    name: HostName
    region: str | None = Field(default=None, max_length=64)
    ib_island: str | None = Field(default=None, min_length=1, max_length=64)
    ttl_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_host_name(v)


class HostJoinToken(_Model):
    name: str
    token: str
    expires_at: datetime
    # What the agent needs to reach this server (its TLS URL and CA).
    server_url: str | None
    ca_fingerprint: str | None


class HostJoin(_Model):
    """``POST /v1/hosts/join`` (the host agent, with its join token)."""

    token: str = Field(min_length=1, max_length=200)
    name: HostName
    address: str = Field(min_length=1, max_length=64)
    port: int = Field(ge=1, le=65535)
    csr_pem: str = Field(min_length=1, max_length=20000)
    inventory: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_host_name(v)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            pass
        if not _DNS_NAME_RE.match(v):
            raise ValueError("must be an IP address or a DNS name")
        return v.lower()


class HostJoined(_Model):
    name: str
    certificate_pem: str
    control_ca_pem: str
    secret: str


class HostHeartbeat(_Model):
    inventory: dict[str, Any] = Field(default_factory=dict)


# --- capacity -----------------------------------------------------------------

MAX_RESERVATION_DAYS = 90


class TimeWindow(_Model):
    start: datetime
    end: datetime

    @field_validator("start", "end")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("give a time zone, e.g. 2026-12-01T00:00:00Z")
        return v

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.end <= self.start:
            raise ValueError("end: must be after start")
        return self


class CapacityCreate(_Model):
    """Capacity set aside for a project: ``reserved`` (one window of 1 to 90
    days) or a ``pool`` (one or more scheduled windows)."""

    name: Name
    project: Name
    kind: CapacityKind = CapacityKind.RESERVED
    gpu_type: str = "H100_SXM"
    region: str | None = None
    num_gpus: GpuCount
    windows: list[TimeWindow] = Field(min_length=1, max_length=100)

    _name = field_validator("name", "project")(check_name)

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, v: int) -> int:
        return check_gpu_count(v, minimum=GPUS_PER_NODE)

    @model_validator(mode="after")
    def _windows(self) -> Self:
        if self.kind is CapacityKind.RESERVED:
            if len(self.windows) != 1:
                raise ValueError("windows: a reservation has exactly one window")
            w = self.windows[0]
            days = (w.end - w.start).total_seconds() / 86400
            if days < 1 or days > MAX_RESERVATION_DAYS:
                raise ValueError(
                    f"windows: a reservation lasts 1 to {MAX_RESERVATION_DAYS} days, got {days:.1f}"
                )
        ordered = sorted(self.windows, key=lambda w: w.start)
        for a, b in itertools.pairwise(ordered):
            if b.start < a.end:
                raise ValueError("windows: a pool's windows must not overlap")
        return self


class CapacityWindowView(_Out):
    start: datetime
    end: datetime
    active: bool


class Capacity(_Out):
    name: str
    project: str
    kind: CapacityKind
    gpu_type: str
    region: str
    num_gpus: int
    windows: list[CapacityWindowView]
    created_at: datetime


class CapacitySplit(_Out):
    """How a cluster's standard GPUs are paid for right now."""

    reserved_gpus: int
    pool_gpus: int
    on_demand_gpus: int


# --- tenancy ------------------------------------------------------------------


class ProjectCreate(_Model):
    name: Name
    description: str = Field(default="", max_length=500)

    _name = field_validator("name")(check_name)


class IdRange(_Out):
    first: int
    last: int


class Project(_Out):
    name: str
    description: str
    role: ProjectRole | None = None
    created_at: datetime
    host_ids: IdRange | None = Field(
        default=None,
        description="the host uids and gids the project's nodes run as (its user namespaces "
        "map node ids 0-65535 onto them); the same on every host (docs/security.md)",
    )


class ApiKeyCreate(_Model):
    """Issue a key for a user (created if new) with a role in a project."""

    user: Name
    project: Name
    role: ProjectRole = ProjectRole.EDITOR

    _user = field_validator("user", "project")(check_name)


class ApiKeyCreated(_Out):
    user: str
    project: str
    role: ProjectRole
    key: str
    key_prefix: str


class QuotaAmounts(_Out):
    standard_gpus: int
    preemptible_gpus: int
    clusters: int
    volume_tib: int


class QuotaLimits(_Model):
    """What a project may hold at once; ``null`` is no limit."""

    standard_gpus: int | None = Field(default=None, ge=0, le=MAX_GPUS)
    preemptible_gpus: int | None = Field(default=None, ge=0, le=MAX_GPUS)
    clusters: int | None = Field(default=None, ge=0, le=100_000)
    volume_tib: int | None = Field(default=None, ge=0, le=1_000_000)


class ProjectQuota(_Out):
    """``GET /v1/projects/{project}/quota``: the limits and what the project
    holds now (any member may look)."""

    project: str
    limits: QuotaLimits
    use: QuotaAmounts


class BudgetSettings(_Model):
    """A project's budget (docs/budgets.md): ``amount`` in the pricing's
    currency per calendar month (UTC), or a prepaid credit counted from
    when it is set; ``policy`` once it is spent and the grace period over."""

    kind: Literal["monthly", "credit"]
    amount: float = Field(gt=0, le=1e12)
    policy: Literal["pause", "stop"] = "pause"
    webhook_url: str | None = Field(
        default=None,
        max_length=2000,
        description="POSTed a JSON document at each alert (docs/budgets.md)",
    )

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("must be an http:// or https:// URL")
        return v


class BudgetAlertView(_Out):
    timestamp: datetime
    kind: str  # threshold, enforced, lifted
    percent: int
    spent: float
    amount: float
    message: str


class ProjectBudget(_Out):
    """``GET /v1/projects/{project}/budget``: the budget and where it stands."""

    project: str
    budget: BudgetSettings | None
    period_start: datetime | None = None
    spent: float = 0.0
    remaining: float | None = None
    percent: float = 0.0
    currency: str = "USD"
    exhausted_since: datetime | None = None
    grace_ends_at: datetime | None = None
    enforced: str | None = Field(
        default=None, description="the policy in force now (pause, stop) or null"
    )
    alerts: list[BudgetAlertView] = Field(default_factory=list)


class SsoInfo(_Out):
    """``GET /v1/auth/sso``: whether this server signs users in through an
    identity provider, and which."""

    enabled: bool
    issuer: str | None = None


class SsoDeviceStart(_Out):
    """The device flow's first step (RFC 8628): open ``verification_uri``
    in a browser and enter ``user_code`` (or open
    ``verification_uri_complete``), then poll with ``device_code``."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None = None
    interval: int = Field(description="seconds to wait between polls")
    expires_in: int = Field(description="seconds the code stays valid")


class SsoDevicePoll(_Model):
    device_code: str = Field(min_length=1, max_length=512)


class SsoPending(_Out):
    """Not signed in yet: poll again after ``interval`` seconds."""

    status: Literal["pending", "slow_down"]
    interval: int


class SsoSignedIn(_Out):
    """A session: ``key`` is its API key (send it as a bearer token), ended
    by ``POST /v1/auth/logout``, at ``expires_at``, or when the identity
    provider stops vouching for the user."""

    user: str
    key: str
    key_prefix: str
    expires_at: datetime
    is_admin: bool
    projects: dict[str, ProjectRole]


class ProjectMember(_Out):
    """A user's membership of a project. ``uid`` is the user's Unix uid on
    cluster nodes (the same on every node of every cluster)."""

    user: str
    role: ProjectRole
    uid: int | None = None


class User(_Out):
    """A user of the organization (``GET /v1/users``, org admins).
    ``projects`` maps each project the user is a member of to their role;
    ``deleted_at`` is set once the user is deleted (their name and uid are
    never reused)."""

    name: str
    uid: int | None = None
    is_admin: bool
    created_at: datetime
    projects: dict[str, ProjectRole] = Field(default_factory=dict)
    deleted_at: datetime | None = None


class RegistryInfo(_Out):
    """The image registry users push to (docs/kubernetes.md "Images")."""

    address: str = Field(description="HOST:PORT; repositories are PROJECT/NAME")
    token_url: str = Field(description="where clients get tokens (user name + API key)")
    ca_pem: str | None = Field(
        default=None, description="the CA its certificate is signed by (None: a public CA)"
    )


class WhoAmI(_Out):
    user: str
    organization: str
    is_admin: bool
    projects: dict[str, ProjectRole]


# --- volumes ------------------------------------------------------------------


class VolumeCreate(_Model):
    name: Name
    size_tib: SizeTib = Field(default=1, description="whole TiB, at least 1")
    region: str | None = None
    is_lifecycle_independent: bool = True

    _name = field_validator("name")(check_name)

    _size = field_validator("size_tib")(check_size_tib)


class VolumeUpdate(_Model):
    size_tib: SizeTib

    _size = field_validator("size_tib")(check_size_tib)


class Volume(_Out):
    name: str
    project: str
    region: str
    size_tib: int
    status: VolumeStatus
    is_lifecycle_independent: bool
    cluster: str | None = None
    created_at: datetime
    deleted_at: datetime | None = None


# --- clusters -----------------------------------------------------------------


MAX_SCRIPT_BYTES = 64 * 1024


class SlurmSettings(_Model):
    """The parts of a Slurm cluster's configuration users own. Saving them
    reconfigures the running cluster (``scontrol reconfigure``)."""

    extra_config: str = Field(
        default="",
        max_length=MAX_SCRIPT_BYTES,
        description="extra slurm.conf lines; keys the service owns are refused",
    )
    prolog: str | None = Field(
        default=None, max_length=MAX_SCRIPT_BYTES, description="prolog script (run before jobs)"
    )
    epilog: str | None = Field(
        default=None, max_length=MAX_SCRIPT_BYTES, description="epilog script (run after jobs)"
    )

    @field_validator("prolog", "epilog")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is not None and v.strip() and not v.startswith("#!"):
            raise ValueError("must start with an interpreter line such as '#!/bin/bash'")
        return v


class RepairSettings(_Model):
    """A cluster's repair policy."""

    automatic: list[str] = Field(
        default_factory=list,
        description='faults (alert kinds) repaired without approval; ["*"] for all',
    )
    max_wait_s: int = Field(
        default=7200,
        ge=-1,
        le=86400,
        description="job protection: wait this long for the node to be idle before "
        "draining it (at most 24 h); -1 never interrupts running work",
    )


MAX_AUTOSCALE_GPUS = GPUS_PER_NODE * 1024  # Slurm's MaxNodeCount for a cluster


class AutoscalingSettings(_Model):
    """The range a cluster's standard GPUs follow its queues in
    (docs/autoscaling.md): nodes are added for work that waits and
    released once idle for ``idle_s``, never below ``min_gpus`` (0: every
    GPU node goes; the control plane and login node stay)."""

    min_gpus: OptionalGpuCount = 0
    max_gpus: Annotated[
        int,
        Field(
            json_schema_extra={
                "minimum": GPUS_PER_NODE,
                "maximum": MAX_AUTOSCALE_GPUS,
                "multipleOf": GPUS_PER_NODE,
            }
        ),
    ]
    idle_s: int = Field(
        default=600,
        ge=30,
        le=86400,
        description="a node idle this long is released (Slurm's SuspendTime)",
    )

    @field_validator("min_gpus")
    @classmethod
    def _min(cls, v: int) -> int:
        return check_gpu_count(v, minimum=0)

    @field_validator("max_gpus")
    @classmethod
    def _max(cls, v: int) -> int:
        v = check_gpu_count(v, minimum=GPUS_PER_NODE)
        if v > MAX_AUTOSCALE_GPUS:
            raise ValueError(f"must be at most {MAX_AUTOSCALE_GPUS}, got {v}")
        return v

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.min_gpus > self.max_gpus:
            raise ValueError(
                f"autoscaling.min_gpus: must not exceed max_gpus ({self.max_gpus}), "
                f"got {self.min_gpus}"
            )
        return self


class ClusterCreate(_Model):
    name: Name
    cluster_type: ClusterType
    gpu_type: str = "H100_SXM"
    num_gpus: OptionalGpuCount = Field(
        description="standard GPUs (whole nodes); 0 only with autoscaling"
    )
    num_preemptible_gpus: OptionalGpuCount = 0
    region: str | None = None
    billing_type: BillingType = BillingType.ON_DEMAND
    reservation_start: datetime | None = None
    reservation_end: datetime | None = None
    start_at: datetime | None = Field(
        default=None,
        description="queue the request to start then (scheduled clusters start at "
        "reservation_start instead)",
    )
    queue_if_unavailable: bool = Field(
        default=False,
        description="if capacity is short, queue the cluster until it fits instead of "
        "failing with capacity_unavailable",
    )
    volume: str | None = Field(default=None, description="attach an existing volume by name")
    volume_size_tib: SizeTib | None = Field(default=None, description="create a new volume")
    cuda_version: str | None = None
    driver_version: str | None = None
    slurm: SlurmSettings | None = Field(default=None, description="Slurm clusters only")
    repair: RepairSettings | None = Field(default=None, description="repair policy")
    egress: bool = Field(
        default=True,
        description="let nodes reach networks outside the machine through NAT on the host",
    )
    autoscaling: AutoscalingSettings | None = Field(
        default=None,
        description="grow and shrink the standard GPUs with the queue (Slurm's jobs, "
        "Kubernetes' pending GPU pods); num_gpus is the size to start at",
    )

    _name = field_validator("name")(check_name)

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, v: int) -> int:
        return check_gpu_count(v, minimum=0)

    @field_validator("num_preemptible_gpus")
    @classmethod
    def _pgpus(cls, v: int) -> int:
        return check_gpu_count(v, minimum=0)

    @field_validator("volume_size_tib")
    @classmethod
    def _vsize(cls, v: int | None) -> int | None:
        return None if v is None else check_size_tib(v)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.slurm is not None and self.cluster_type is not ClusterType.SLURM:
            raise ValueError("slurm: only Slurm clusters have Slurm settings")
        check_autoscaling(self.autoscaling, self)
        if self.volume is not None and self.volume_size_tib is not None:
            raise ValueError("volume: give either an existing volume or volume_size_tib, not both")
        for name in ("reservation_start", "reservation_end", "start_at"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name}: give a time zone, e.g. 2026-12-01T00:00:00Z")
        if self.billing_type in (BillingType.RESERVED, BillingType.SCHEDULED_CAPACITY):
            if self.start_at is not None:
                raise ValueError(
                    f"start_at: a {self.billing_type.value} cluster starts at reservation_start"
                )
            if self.reservation_start is None or self.reservation_end is None:
                raise ValueError(
                    f"reservation_end: billing_type {self.billing_type.value} needs "
                    "reservation_start and reservation_end"
                )
            if self.reservation_end <= self.reservation_start:
                raise ValueError("reservation_end: must be after reservation_start")
            if self.billing_type is BillingType.RESERVED:
                days = (self.reservation_end - self.reservation_start).total_seconds() / 86400
                if days < 1 or days > 90:
                    raise ValueError(
                        f"reservation_end: a reservation lasts 1 to 90 days, got {days:.1f}"
                    )
        elif self.reservation_start is not None or self.reservation_end is not None:
            raise ValueError(
                "reservation_start: only reserved and scheduled_capacity clusters "
                "have a reservation"
            )
        return self


def check_autoscaling(autoscaling: AutoscalingSettings | None, create: ClusterCreate) -> None:
    """The rules a create's size and autoscaling meet together."""
    if autoscaling is None:
        if create.num_gpus < GPUS_PER_NODE:
            raise ValueError(
                f"num_gpus: must be at least {GPUS_PER_NODE} unless autoscaling is set, "
                f"got {create.num_gpus}"
            )
        return
    if create.num_preemptible_gpus:
        raise ValueError(
            "autoscaling: not with num_preemptible_gpus (the preemptible pool has its own target)"
        )
    if create.billing_type is not BillingType.ON_DEMAND:
        raise ValueError("autoscaling: on-demand clusters only (a reservation has a fixed size)")
    if not autoscaling.min_gpus <= create.num_gpus <= autoscaling.max_gpus:
        raise ValueError(
            f"num_gpus: must lie within autoscaling's {autoscaling.min_gpus}-"
            f"{autoscaling.max_gpus}, got {create.num_gpus}"
        )


class ClusterUpdate(_Model):
    """Scale and extend. Every field is optional; absent fields are unchanged."""

    num_gpus: GpuCount | None = None
    num_preemptible_gpus: OptionalGpuCount | None = None
    reservation_end: datetime | None = None
    slurm: SlurmSettings | None = None
    repair: RepairSettings | None = None
    egress: bool | None = Field(default=None, description="switch nodes' outside access")
    autoscaling: AutoscalingSettings | None = Field(
        default=None, description="a new range for an autoscaled cluster"
    )

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, v: int | None) -> int | None:
        return None if v is None else check_gpu_count(v, minimum=GPUS_PER_NODE)

    @field_validator("num_preemptible_gpus")
    @classmethod
    def _pgpus(cls, v: int | None) -> int | None:
        return None if v is None else check_gpu_count(v, minimum=0)


# How the controllers are getting on with a node or cluster (both carry these).
Retries = Annotated[
    int, Field(description="failed attempts of its current step in a row (0 once one works)")
]
LastError = Annotated[str | None, Field(description="the last failed attempt's error")]
NextAttemptAt = Annotated[
    datetime | None, Field(description="when a failed step is tried again (exponential backoff)")
]
PhaseDeadlineAt = Annotated[
    datetime | None,
    Field(
        description="when its current phase (a cluster: status) must end: past it, it fails "
        "with the reason (a release or delete skips what still fails and finishes)"
    ),
]


class PhaseTransition(_Out):
    phase: str
    timestamp: datetime
    message: str = ""


class Node(_Out):
    name: str
    cluster: str
    host: str | None
    compute_class: ComputeClass
    phase: NodePhase
    gpu_type: str
    num_gpus: int = GPUS_PER_NODE
    cordoned: bool = False
    address: str | None = None
    message: str = ""
    created_at: datetime
    ready_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    deleted_at: datetime | None = None
    auto_repair: bool = True
    gpu_backend: str | None = Field(default=None, description="nvml or simulated")
    retries: Retries = 0
    last_error: LastError = None
    next_attempt_at: NextAttemptAt = None
    phase_deadline_at: PhaseDeadlineAt = None


class Endpoint(_Out):
    """A host and port users connect to from their own machines."""

    host: str
    port: int


class Cluster(_Out):
    name: str
    project: str
    cluster_type: ClusterType
    gpu_type: str
    region: str
    num_gpus: int
    num_preemptible_gpus: int
    desired_preemptible_gpus: int
    allocated_preemptible_gpus: int
    billing_type: BillingType
    reservation_start: datetime | None = None
    reservation_end: datetime | None = None
    start_at: datetime | None = Field(
        default=None, description="a queued cluster's start (its nodes are placed from then on)"
    )
    capacity: CapacitySplit | None = Field(
        default=None, description="how its standard GPUs are paid for now"
    )
    status: ClusterStatus
    status_message: str = ""
    retries: Retries = 0
    last_error: LastError = None
    next_attempt_at: NextAttemptAt = None
    phase_deadline_at: PhaseDeadlineAt = None
    force_delete_reason: str | None = Field(
        default=None, description="why an organization admin forced its delete (and who)"
    )
    volume: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    slurm: SlurmSettings | None = None
    repair: RepairSettings | None = None
    egress: bool = Field(default=True, description="nodes reach networks outside the machine (NAT)")
    autoscaling: AutoscalingSettings | None = Field(
        default=None, description="the range num_gpus follows the queue in; none: fixed size"
    )
    ssh_endpoint: Endpoint | None = Field(
        default=None, description="SSH to the login node, through the gateway (Slurm clusters)"
    )
    kubernetes_endpoint: str | None = Field(
        default=None, description="the Kubernetes API through the gateway (https://HOST:PORT)"
    )
    registry: str | None = Field(
        default=None,
        description="where to push images its pods pull (HOST:PORT/PROJECT; log in with your "
        "user name and API key); none where the server runs no registry",
    )
    phase_history: list[PhaseTransition]
    nodes: list[Node]
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None = None


class NodeEvent(_Out):
    node: str
    cluster: str
    reason: str
    message: str
    timestamp: datetime
    first_timestamp: datetime
    count: int


class AuditEvent(_Out):
    """One mutating API call or console action (docs/identity.md)."""

    timestamp: datetime
    user: str = Field(description='who ("" when the caller was not authenticated)')
    via: str = Field(description="api or console")
    address: str = Field(description="the caller's network address")
    action: str = Field(description="what: the operation's name, e.g. create_cluster")
    method: str
    route: str
    project: str | None
    object: str = Field(description="on which object, e.g. clusters/demo")
    status: int = Field(description="the HTTP status answered")
    outcome: str = Field(description="ok, refused (4xx) or failed (5xx)")
    detail: str = Field(description="the error's code and message, when refused or failed")


class UsageLine(_Out):
    """GPU-hours and cost of one cluster's nodes of one compute class."""

    cluster: str
    compute_class: ComputeClass
    billing: str = Field(description="on_demand | reserved | pool | preemptible")
    gpu_type: str
    nodes: int
    node_hours: float
    gpu_hours: float
    rate_per_gpu_hour: float
    cost: float


class UsageByLine(_Out):
    """One row of ``GET .../usage?by=user|cluster``."""

    key: str  # the user or cluster
    gpu_hours: float
    cost: float


class UsageReport(_Out):
    project: str
    since: datetime
    until: datetime
    currency: str = "USD"
    lines: list[UsageLine]
    total_gpu_hours: float
    total_cost: float
    by: Literal["user", "cluster"] | None = None
    groups: list[UsageByLine] = Field(
        default_factory=list, description="totals per user or cluster (with by=)"
    )


class AgentHeartbeat(_Model):
    """What a node agent reports (internal API, not under /v1)."""

    node_id: str
    seq: int
    sent_at: float
    gpus: list[dict[str, object]] = Field(default_factory=list)
    gpu_backend: str | None = None
    # Current passive findings (core.health.findings.Finding.to_dict()); None
    # from an agent that does not run passive checks.
    findings: list[dict[str, Any]] | None = None
    # One sample per GPU (core.telemetry.GpuSample's fields); None from an
    # agent that does not sample.
    telemetry: list[dict[str, float]] | None = None


class SshTarget(_Out):
    """How to reach a node's shell as the caller's own Unix account."""

    cluster: str
    node: str
    user: str
    argv: list[str]


class SshRequest(_Model):
    """Body of ``POST .../clusters/{name}/ssh`` (may be omitted): the
    operator's path on the server machine (a local command line into the
    node). Users log in over SSH with a certificate instead
    (``.../ssh-certificate``)."""

    command: list[str] = Field(
        default_factory=list, description="command to run (default: a login shell)"
    )
    as_root: bool = Field(
        default=False, description="a root shell in the node (organization admins only)"
    )


SSH_KEY_NAME_MAX = 128
_SSH_KEY_NAME_RE = re.compile(
    rf"^ *[\x21-\x7e]([\x20-\x7e]{{0,{SSH_KEY_NAME_MAX - 2}}}[\x21-\x7e])? *$"
)
SshKeyName = Annotated[str, Field(json_schema_extra={"pattern": _SSH_KEY_NAME_RE.pattern})]


class SshKeyCreate(_Model):
    """A public key to register (``POST /v1/ssh-keys``): one OpenSSH line,
    what ``~/.ssh/id_ed25519.pub`` holds."""

    public_key: str = Field(description="'<type> <base64> [comment]'")
    name: SshKeyName | None = Field(
        default=None, description="a label for the key (default: the key's comment)"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _SSH_KEY_NAME_RE.match(v):
            raise ValueError(
                f"must be 1-{SSH_KEY_NAME_MAX} printable ASCII characters "
                "(spaces around them are dropped)"
            )
        return None if v is None else v.strip(" ")


class SshKey(_Out):
    """A registered public key (its owner may log in with it as their own
    Unix account on every cluster of their projects)."""

    id: str
    name: str
    key_type: str
    fingerprint: str  # "SHA256:...", as ssh-keygen -l shows it
    public_key: str  # "<type> <base64>"
    created_at: datetime


class SshCa(_Out):
    """The organization's SSH certificate authorities (``GET /v1/ssh-ca``).
    ``known_hosts`` is an ``@cert-authority`` line that makes ssh trust every
    cluster's login node on the gateway host, on any port."""

    user_ca_public_key: str
    host_ca_public_key: str
    gateway_host: str
    known_hosts: str


class SshCertificateRequest(_Model):
    """Body of ``POST .../clusters/{name}/ssh-certificate``."""

    public_key: str = Field(description="the key to certify, '<type> <base64> [comment]'")
    node: str | None = Field(
        default=None, description="a node to reach through the login node (its name)"
    )


class SshCertificate(_Out):
    """A short-lived user certificate and where to use it: ``ssh -i KEY -o
    CertificateFile=CERT -p PORT USER@HOST`` (with ``known_hosts`` in the
    known-hosts file); with ``node_host``, jump through that login to it."""

    cluster: str
    user: str
    principal: str
    certificate: str  # "ssh-ed25519-cert-v01@openssh.com AAAA..."
    valid_before: datetime
    host: str
    port: int
    known_hosts: str
    node_host: str | None = None


_CONTEXT_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._@:/+-]{0,251}[A-Za-z0-9])?")
CONTEXT_NAME_RULE = (
    "must be 1-253 characters of letters, digits and . _ @ : / + -, "
    "starting and ending with a letter or digit"
)


class CredentialsRequest(_Model):
    """Options for ``POST .../clusters/{name}/credentials`` (the body may be
    omitted)."""

    context_name: str | None = Field(
        default=None, description="name the kubeconfig context (default: the cluster's name)"
    )

    @field_validator("context_name")
    @classmethod
    def _check_context_name(cls, value: str | None) -> str | None:
        if value is not None and not _CONTEXT_NAME_RE.fullmatch(value):
            raise ValueError(CONTEXT_NAME_RULE)
        return value


class ClusterToken(_Out):
    """A token of minutes for the caller on one cluster's Kubernetes API
    (what the kubeconfig's exec credential plugin hands kubectl)."""

    cluster: str
    user: str
    token: str
    expires_at: datetime


class ClusterCredentials(_Out):
    """A kubeconfig for the caller on the cluster's Kubernetes API: the
    context (and its cluster and user entries, ``<context>`` and
    ``<user>@<context>``) is current. Its user runs ``gpuclusters clusters
    token`` for a token at each kubectl run where the server signs tokens
    (docs/identity.md); elsewhere a client certificate is embedded."""

    cluster: str
    context: str
    user: str
    kubeconfig: str


# --- health and repair --------------------------------------------------------


class HealthAlert(_Out):
    id: str
    cluster: str
    node: str
    kind: str
    severity: str = Field(description="info | warning | critical")
    gpu: int | None = None
    code: int | None = Field(default=None, description="the Xid, for Xid alerts")
    subject: str | None = Field(default=None, description="the daemon or port it is about")
    message: str
    started_at: datetime
    last_seen_at: datetime
    resolved_at: datetime | None = None


class RepairActionName(StrEnum):
    REBOOT = "reboot"
    REPROVISION = "reprovision"
    MIGRATE = "migrate"
    REMOVE = "remove"


class Repair(_Out):
    """A remediation record."""

    id: str
    cluster: str
    node: str
    action: str
    state: str = Field(
        description="pending_approval | pending | running | succeeded | failed | cancelled "
        "| auto_resolved"
    )
    step: str | None = Field(
        default=None,
        description="while running: cordoning, draining, repairing, migrating, joining",
    )
    trigger: str = Field(description="manual | automated")
    reason: str
    message: str = ""
    requested_by: str | None = None
    reviewed_by: str | None = None
    idempotency_key: str
    alert_ids: list[str]
    health_run_ids: list[str]
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class RepairCreate(_Model):
    """A manual repair of one node; the same ``idempotency_key`` answers the
    record it made the first time."""

    node: Name
    action: RepairActionName
    reason: str = Field(default="", max_length=1000)
    idempotency_key: str = Field(min_length=1, max_length=64)


class FaultSpec(_Model):
    """A simulated fault (embedded fleet only)."""

    kind: str
    gpu: int = Field(default=0, ge=0, le=7)
    code: int | None = Field(default=None, description="the Xid for kind xid; replays/min")

    @model_validator(mode="after")
    def _kind(self) -> Self:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(FAULT_KINDS)}")
        if self.kind == "xid" and (self.code is None or self.code <= 0):
            raise ValueError("code: an Xid fault needs its code, e.g. 79")
        return self


class HealthRunCreate(_Model):
    check: str
    node: Name | None = Field(default=None, description="one node (default: every running node)")
    duration_s: float = Field(default=60.0, gt=0, le=3600)

    @field_validator("check")
    @classmethod
    def _check(cls, v: str) -> str:
        if v not in ACTIVE_CHECKS:
            raise ValueError(f"must be one of {', '.join(ACTIVE_CHECKS)}")
        return v


class HealthRun(_Out):
    id: str
    cluster: str
    node: str
    check: str
    state: str = Field(description="pending | running | passed | failed | skipped")
    reason: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)
    output: str = ""
    duration_s: float
    requested_by: str | None = Field(default=None, description='a user, or "acceptance"')
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class NodeUpdate(_Model):
    auto_repair: bool
