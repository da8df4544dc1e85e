"""SQLAlchemy models.

Controllers claim rows with lease columns (``lock_owner``, ``lock_token``,
``lock_expires_at``) and write back only while their token still matches, so
two workers (or a worker and its own ghost after a restart) never act on one
row at once. One live node per host is enforced by a partial unique index,
so even a buggy caller cannot double-book a host.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops tzinfo)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def live_unique(name: str, *columns: str) -> Index:
    """A unique index over the rows not deleted (``deleted_at IS NULL``):
    a name, host or port is taken only while its holder lives."""
    live = text("deleted_at IS NULL")
    return Index(name, *columns, unique=True, sqlite_where=live, postgresql_where=live)


def live_index(name: str, *columns: str) -> Index:
    """An index over the live rows only: the controllers' hot queries never
    look at deleted ones, which pile up over a fleet's life."""
    live = text("deleted_at IS NULL")
    return Index(name, *columns, sqlite_where=live, postgresql_where=live)


class Base(DeclarativeBase):
    pass


class LeaseMixin:
    """A row the controllers work on: its lease, and the outcome of the last
    attempt (kept on the row, not in a process's memory, so a restart or
    another replica goes on with the same backoff and users see why a row
    is stuck; controllers/base.py)."""

    lock_owner: Mapped[str | None] = mapped_column(String(64), default=None)
    lock_token: Mapped[str | None] = mapped_column(String(32), default=None)
    lock_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # Failed attempts in a row (0 after a step that succeeds), the last one's
    # error, and when the next may start (the backoff).
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class Organization(Base):
    __tablename__ = "organizations"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (
        UniqueConstraint("organization_id", "name"),
        UniqueConstraint("id_block", name="uq_projects_id_block"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    organization_id: Mapped[str] = mapped_column(ForeignKey("organizations.id"))
    name: Mapped[str] = mapped_column(String(64))
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The project's host id block (core/idblocks.py): its nodes' uids and
    # gids on every host. Unique across organizations, never reused.
    id_block: Mapped[int] = mapped_column(Integer)


class ProjectQuota(Base):
    """What a project may hold at once (``core/quotas.py``); a column of
    None is no limit, and a project without a row has none."""

    __tablename__ = "project_quotas"
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    standard_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    preemptible_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    clusters: Mapped[int | None] = mapped_column(Integer, default=None)
    volume_tib: Mapped[int | None] = mapped_column(Integer, default=None)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(64), default="")


class ProjectBudget(Base):
    """A project's budget (core/budgets.py): money per month or a prepaid
    credit, the policy once it is spent, and where the enforcement stands."""

    __tablename__ = "project_budgets"
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # monthly, credit
    amount: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String(16))  # pause, stop
    webhook_url: Mapped[str | None] = mapped_column(Text, default=None)
    # A credit counts spending from when it was set (a top-up sets it anew).
    credit_since: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Alerts: the period they were given in and the highest threshold given.
    alert_period: Mapped[str] = mapped_column(String(40), default="")
    alerted_percent: Mapped[int] = mapped_column(Integer, default=0)
    exhausted_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # The policy in force now (None: nothing held back).
    enforced: Mapped[str | None] = mapped_column(String(16), default=None)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(64), default="")


class BudgetAlert(Base):
    """One alert of a project's budget: a threshold crossed, or its
    policy applied or lifted. Kept as long as the project."""

    __tablename__ = "budget_alerts"
    __table_args__ = (Index("ix_budget_alerts_project_time", "project_id", "timestamp"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    timestamp: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(16))  # threshold, enforced, lifted
    percent: Mapped[int] = mapped_column(Integer, default=0)
    spent: Mapped[float] = mapped_column(Float, default=0.0)
    amount: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str] = mapped_column(Text, default="")


class User(Base):
    __tablename__ = "users"
    __table_args__ = (
        UniqueConstraint("organization_id", "name"),
        UniqueConstraint("organization_id", "uid", name="uq_users_org_uid"),
        UniqueConstraint("organization_id", "sso_subject", name="uq_users_org_sso_subject"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    organization_id: Mapped[str] = mapped_column(ForeignKey("organizations.id"))
    name: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    # Unix uid of the user's account on cluster nodes: the same on every node
    # of every cluster, so files on shared volumes keep their owner.
    uid: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Set by ``DELETE /v1/users/{name}``. The row stays, so its name and uid
    # are never handed out again (files on shared volumes keep their owner).
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # The identity provider's stable id of a user who signs in with single
    # sign-on (docs/identity.md): what links sign-ins to this row.
    sso_subject: Mapped[str | None] = mapped_column(String(255), default=None)


class ApiKey(Base):
    """Bearer tokens. Only a SHA-256 of the key is stored: keys are 256-bit
    random, so a fast hash is enough and a lookup stays one indexed query."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"))
    key_prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # A single sign-on session's key ends with the session; others never do.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class ConsoleSession(Base):
    """A signed-in browser (server/routers/console.py). The cookie holds a
    random token; only its SHA-256 is the key here. The session acts with
    the API key it was opened with: revoking the key, or deleting its user,
    ends it. ``csrf_token`` is echoed by every form and mutating request."""

    __tablename__ = "console_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the cookie
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class SsoSession(Base):
    """A single sign-on session (services/sso.py): the API key it signed the
    user in with, and the identity provider's refresh token, with which the
    server rechecks the user every ``sso_recheck_interval_s``. Ended
    sessions stay as the record (``ended_at``, ``end_reason``)."""

    __tablename__ = "sso_sessions"
    __table_args__ = (Index("ix_sso_sessions_due", "ended_at", "checked_at"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    via: Mapped[str] = mapped_column(String(16))  # cli (device flow) or console
    refresh_token: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    checked_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    end_reason: Mapped[str] = mapped_column(Text, default="")


class SsoLogin(Base):
    """A console sign-in under way (the authorization-code flow): the PKCE
    verifier and nonce for its ``state``, kept until the provider sends the
    browser back (any replica may receive it), for ten minutes at most."""

    __tablename__ = "sso_logins"
    state_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    verifier: Mapped[str] = mapped_column(String(128))
    nonce: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class ProjectMember(Base):
    __tablename__ = "project_members"
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))


class Host(Base):
    """Fleet inventory, synced from the provider's fleet at start."""

    __tablename__ = "hosts"
    # Placement counts and picks free hosts of one kind, island by island;
    # the host list pages by (created_at, name).
    __table_args__ = (
        Index("ix_hosts_kind", "gpu_type", "region", "ib_island", "name"),
        Index("ix_hosts_created", "created_at", "name"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    region: Mapped[str] = mapped_column(String(64))
    gpu_type: Mapped[str] = mapped_column(String(32))
    num_gpus: Mapped[int] = mapped_column(Integer, default=8)
    nvme_gib: Mapped[int] = mapped_column(Integer)
    ib_island: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default="available")
    in_fleet: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Hosts with a host agent (docs/hosts.md); fleet-file hosts have none of
    # these. ``agent_status``: joining -> ready <-> unreachable; removed.
    agent_status: Mapped[str | None] = mapped_column(String(16), default=None)
    address: Mapped[str | None] = mapped_column(String(64), default=None)
    agent_port: Mapped[int | None] = mapped_column(Integer, default=None)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    inventory: Mapped[str | None] = mapped_column(Text, default=None)  # JSON
    secret_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    cert_fingerprint: Mapped[str | None] = mapped_column(String(128), default=None)


class HostJoinToken(Base):
    """A one-use token that lets a host agent join as host ``host_name``
    (made by ``gpuclusters hosts add``). Only its SHA-256 is stored."""

    __tablename__ = "host_join_tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    host_name: Mapped[str] = mapped_column(String(64))
    region: Mapped[str] = mapped_column(String(64))
    ib_island: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class Volume(LeaseMixin, Base):
    __tablename__ = "volumes"
    __table_args__ = (live_unique("uq_volumes_live_name", "project_id", "name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(64))
    region: Mapped[str] = mapped_column(String(64))
    size_tib: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    is_lifecycle_independent: Mapped[bool] = mapped_column(Boolean, default=True)
    cluster_id: Mapped[str | None] = mapped_column(ForeignKey("clusters.id"), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class Cluster(LeaseMixin, Base):
    __tablename__ = "clusters"
    __table_args__ = (
        live_unique("uq_clusters_live_name", "project_id", "name"),
        live_unique("uq_clusters_live_ssh_port", "ssh_port"),
        live_unique("uq_clusters_live_kubernetes_port", "kubernetes_port"),
        Index("ix_clusters_project_created", "project_id", "created_at", "name"),
        live_index("ix_clusters_live_status", "status"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(64))
    cluster_type: Mapped[str] = mapped_column(String(16))
    gpu_type: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(64))
    num_gpus: Mapped[int] = mapped_column(Integer)
    num_preemptible_gpus: Mapped[int] = mapped_column(Integer, default=0)
    billing_type: Mapped[str] = mapped_column(String(32))
    reservation_start: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    reservation_end: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    cuda_version: Mapped[str | None] = mapped_column(String(32), default=None)
    driver_version: Mapped[str | None] = mapped_column(String(32), default=None)
    status: Mapped[str] = mapped_column(String(32))
    status_message: Mapped[str] = mapped_column(Text, default="")
    delete_volume: Mapped[bool] = mapped_column(Boolean, default=False)
    volume_id: Mapped[str | None] = mapped_column(String(32), default=None)
    # Slurm settings users may change; a change bumps config_generation and
    # the cluster reconciler applies it live until applied_config_generation
    # catches up.
    slurm_extra_config: Mapped[str] = mapped_column(Text, default="")
    slurm_prolog: Mapped[str | None] = mapped_column(Text, default=None)
    slurm_epilog: Mapped[str | None] = mapped_column(Text, default=None)
    config_generation: Mapped[int] = mapped_column(Integer, default=1)
    applied_config_generation: Mapped[int] = mapped_column(Integer, default=0)
    created_by: Mapped[str | None] = mapped_column(String(64), default=None)
    # A queued request: standard nodes are placed from this time on (the
    # reservation start for scheduled clusters, or a requested start); until
    # then, and while capacity is short, the cluster stays queued.
    start_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    nodes_placed: Mapped[bool] = mapped_column(Boolean, default=True)
    # Repair policy: alert kinds repaired without approval ("*": all), and
    # job protection (seconds to wait for an idle node; -1: never interrupt).
    repair_automatic: Mapped[str] = mapped_column(Text, default="")
    repair_max_wait_s: Mapped[int] = mapped_column(Integer, default=7200)
    # When the "reservation ends in 24 h" warning was given (once per end).
    end_warned_for: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # The gateway's ports for this cluster (docs/access.md): SSH to the login
    # node and the Kubernetes API, allocated once from the configured range
    # and kept for the cluster's life (unique among live clusters).
    gateway_host: Mapped[str | None] = mapped_column(String(253), default=None)
    ssh_port: Mapped[int | None] = mapped_column(Integer, default=None)
    kubernetes_port: Mapped[int | None] = mapped_column(Integer, default=None)
    # Nodes reach networks outside the machine through NAT on the host.
    egress: Mapped[bool] = mapped_column(Boolean, default=True)
    # When the current status must be left by (settings'
    # cluster_phase_deadlines_s; None: no deadline).
    phase_deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # When the control plane first came up: a delete skips the layer steps
    # of a cluster whose control plane never did (there is nothing to undo).
    control_plane_ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # ``clusters delete --force``: who forced it and why (layer and provider
    # steps that fail are then skipped at once, each with an event).
    force_delete_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # Autoscaling (core/autoscale.py): the range num_gpus follows the queue
    # in, and the idle time after which a node goes; max None: fixed size.
    autoscale_min_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    autoscale_max_gpus: Mapped[int | None] = mapped_column(Integer, default=None)
    autoscale_idle_s: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)

    phases: Mapped[list[ClusterPhase]] = relationship(
        order_by="ClusterPhase.seq", cascade="all, delete-orphan", lazy="raise"
    )


class ClusterPhase(Base):
    __tablename__ = "cluster_phases"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    timestamp: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Node(LeaseMixin, Base):
    __tablename__ = "nodes"
    __table_args__ = (
        # One live node per host, enforced by the database.
        live_unique("uq_nodes_live_host", "host_id"),
        Index("ix_nodes_cluster", "cluster_id"),
        # Lists page through a project's nodes in this order.
        Index("ix_nodes_project_created", "project_id", "created_at", "name"),
        # The node reconciler asks for live nodes by phase; placement for
        # hosts that live nodes await.
        live_index("ix_nodes_live_phase", "phase"),
        live_index("ix_nodes_live_awaited_host", "awaited_host_id"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    name: Mapped[str] = mapped_column(String(64), unique=True)
    host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id"), default=None)
    compute_class: Mapped[str] = mapped_column(String(16))
    phase: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text, default="")
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    address: Mapped[str | None] = mapped_column(String(64), default=None)
    agent_token_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # Set when the node must go (scale-down, cluster delete); the node
    # reconciler drains and releases it.
    to_delete: Mapped[bool] = mapped_column(Boolean, default=False)
    delete_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    # A standard node placed on a host that a preempted node still holds
    # waits here (host_id stays empty: one live node per host) until that
    # node is released, then takes the host.
    awaited_host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id"), default=None)
    # Preemption (delete_reason "preempted"): T+0 plus the grace window, set
    # once when the protocol starts; the node is released when its work is
    # gone or at this time, whichever comes first.
    preempt_deadline: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    preempt_signalled: Mapped[bool] = mapped_column(Boolean, default=False)
    # Automatic repair may be turned off per node; the agent says whether
    # its GPUs are real (nvml) or simulated (fault injection allowed).
    auto_repair: Mapped[bool] = mapped_column(Boolean, default=True)
    # An autoscaled cluster's standard node holds one of its slots (the
    # scheduler's name for it) until the node is deleted.
    slot: Mapped[str | None] = mapped_column(String(64), default=None)
    gpu_backend: Mapped[str | None] = mapped_column(String(16), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    phase_changed_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # When the current phase must be left by (settings' node_phase_deadlines_s).
    phase_deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class NodeEvent(Base):
    """Lifecycle events, one row per (node, reason): a repeat bumps the count
    and timestamp instead of adding a row (contract: deduplicated)."""

    __tablename__ = "node_events"
    # The event list pages a project's events newest first.
    __table_args__ = (
        UniqueConstraint("node_id", "reason"),
        Index("ix_node_events_project_time", "project_id", "timestamp", "node_name"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id"), index=True)
    node_id: Mapped[str] = mapped_column(String(32))
    node_name: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    count: Mapped[int] = mapped_column(Integer, default=1)
    first_timestamp: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    timestamp: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class AuditEvent(Base):
    """One mutating API call or console action (``server/audit.py``): who,
    from where, what, on which object, and the outcome. Rows are never
    updated; housekeeping deletes those older than ``audit_retention_days``."""

    __tablename__ = "audit_events"
    # The log pages newest first by (timestamp, user_name, id), for all,
    # one project, or one user.
    __table_args__ = (
        Index("ix_audit_time", "timestamp", "user_name", "id"),
        Index("ix_audit_project_time", "project_id", "timestamp"),
        Index("ix_audit_user_time", "user_name", "timestamp"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    timestamp: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    organization_id: Mapped[str | None] = mapped_column(String(32), default=None)
    user_id: Mapped[str | None] = mapped_column(String(32), default=None)
    # "" when the caller was not authenticated (a refused key, a failed sign-in).
    user_name: Mapped[str] = mapped_column(String(64), default="")
    via: Mapped[str] = mapped_column(String(16))  # api, console, host
    address: Mapped[str] = mapped_column(String(64), default="")
    method: Mapped[str] = mapped_column(String(8))
    action: Mapped[str] = mapped_column(String(64))  # the route's name
    route: Mapped[str] = mapped_column(String(200))
    project_id: Mapped[str | None] = mapped_column(String(32), default=None)
    project_name: Mapped[str] = mapped_column(String(64), default="")
    object: Mapped[str] = mapped_column(String(300), default="")
    status: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))  # ok, refused, failed
    detail: Mapped[str] = mapped_column(Text, default="")


class UsageRecord(Base):
    """Metering: one row per node from the moment it is live (running) to
    its release. Open rows (``ended_at`` NULL) are billed up to now. Rows
    copy what pricing needs (GPU type, class, GPU count, names), so they
    outlive the node and the cluster unchanged."""

    __tablename__ = "usage_records"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    cluster_id: Mapped[str] = mapped_column(String(32))
    cluster_name: Mapped[str] = mapped_column(String(64))
    node_id: Mapped[str] = mapped_column(String(32), index=True)
    node_name: Mapped[str] = mapped_column(String(64))
    gpu_type: Mapped[str] = mapped_column(String(32))
    compute_class: Mapped[str] = mapped_column(String(16))
    # How the node is paid for: reserved | pool | on_demand | preemptible
    # (decided when it goes live, from the project's active capacity windows).
    billing: Mapped[str] = mapped_column(String(16))
    num_gpus: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # Who created the cluster (usage reports by user); "" before 0017.
    user_name: Mapped[str] = mapped_column(String(64), default="", server_default="")


class CapacityWindow(Base):
    """Capacity set aside for a project for a time: ``reserved`` (prepaid)
    or one scheduled window of a capacity ``pool``. A pool with several
    windows has one row per window, all with the pool's name."""

    __tablename__ = "capacity_windows"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), index=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    gpu_type: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(64))
    num_gpus: Mapped[int] = mapped_column(Integer)
    start_at: Mapped[datetime] = mapped_column(UTCDateTime())
    end_at: Mapped[datetime] = mapped_column(UTCDateTime())
    created_by: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Alert(Base):
    """A passive health finding on a node, open until it stops being seen.
    One open alert per (node, kind, gpu, subject); ``gpu`` is -1 for a
    node-level alert, ``subject`` names the daemon or port it is about."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index(
            "uq_alerts_open",
            "node_id",
            "kind",
            "gpu",
            "subject",
            unique=True,
            sqlite_where=text("resolved_at IS NULL"),
            postgresql_where=text("resolved_at IS NULL"),
        ),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    cluster_id: Mapped[str] = mapped_column(String(32), index=True)
    node_id: Mapped[str] = mapped_column(String(32), index=True)
    node_name: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    gpu: Mapped[int] = mapped_column(Integer, default=-1)
    subject: Mapped[str] = mapped_column(String(64), default="")
    code: Mapped[int | None] = mapped_column(Integer, default=None)
    message: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[str] = mapped_column(Text, default="{}")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class Remediation(LeaseMixin, Base):
    """A repair of one node: recommended by the rules (automated) or asked
    for by a person (manual), approved or not, then carried out by the
    repair reconciler step by step (``step``)."""

    __tablename__ = "remediations"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    cluster_id: Mapped[str] = mapped_column(String(32), index=True)
    node_id: Mapped[str] = mapped_column(String(32), index=True)
    node_name: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(24), index=True)
    trigger: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    kinds: Mapped[str] = mapped_column(Text, default="")  # alert kinds, comma-separated
    requested_by: Mapped[str | None] = mapped_column(String(64), default=None)
    reviewed_by: Mapped[str | None] = mapped_column(String(64), default=None)
    idempotency_key: Mapped[str] = mapped_column(String(128), unique=True)
    alert_ids: Mapped[str] = mapped_column(Text, default="[]")
    health_run_ids: Mapped[str] = mapped_column(Text, default="[]")
    step: Mapped[str] = mapped_column(String(16), default="")
    step_changed_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    message: Mapped[str] = mapped_column(Text, default="")
    old_host_id: Mapped[str | None] = mapped_column(String(32), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class HealthRun(LeaseMixin, Base):
    """One active check on one node: pending -> running -> passed | failed |
    skipped, with the reason, metrics (JSON) and output."""

    __tablename__ = "health_runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), index=True)
    cluster_id: Mapped[str] = mapped_column(String(32), index=True)
    node_id: Mapped[str] = mapped_column(String(32))
    node_name: Mapped[str] = mapped_column(String(64))
    check: Mapped[str] = mapped_column(String(32))
    duration_s: Mapped[float] = mapped_column(Float, default=60.0)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    metrics: Mapped[str] = mapped_column(Text, default="{}")
    output: Mapped[str] = mapped_column(Text, default="")
    requested_by: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class SshKey(Base):
    """A public key a user registered; sshd on every cluster of the user's
    projects accepts it for the user's own account. A delete sets
    ``deleted_at`` (the access sync drops it from nodes within a minute)."""

    __tablename__ = "ssh_keys"
    __table_args__ = (live_unique("uq_ssh_keys_live_fingerprint", "user_id", "fingerprint"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_type: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[str] = mapped_column(Text)  # "<type> <base64>", no comment
    fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)


class SshAuthority(Base):
    """An organization's SSH certificate authority: ``user`` signs members'
    short-lived keys, ``host`` signs nodes' host keys. Made on first use."""

    __tablename__ = "ssh_authorities"
    organization_id: Mapped[str] = mapped_column(ForeignKey("organizations.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # "user" | "host"
    private_key: Mapped[str] = mapped_column(Text)  # OpenSSH PEM, Ed25519
    public_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ControllerLease(Base):
    """A named lease on work that one server process does for all (the
    housekeeping chores, the access sync): with several replicas on one
    database, the holder does it and the others wait for the lease to expire
    or be released. Claimed by compare-and-set, like the rows' leases."""

    __tablename__ = "controller_leases"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(64), default=None)
    token: Mapped[str | None] = mapped_column(String(64), default=None)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
