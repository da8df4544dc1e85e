"""health alerts, repairs, health runs

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 08:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEASE = (
    ("lock_owner", sa.String(length=64)),
    ("lock_token", sa.String(length=32)),
    ("lock_expires_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("repair_automatic", sa.Text(), nullable=False, server_default="")
        )
        batch_op.add_column(
            sa.Column("repair_max_wait_s", sa.Integer(), nullable=False, server_default="7200")
        )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("auto_repair", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        batch_op.add_column(sa.Column("gpu_backend", sa.String(length=16), nullable=True))

    op.create_table(
        "alerts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("cluster_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("node_name", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.Column("subject", sa.String(length=64), nullable=False),
        sa.Column("code", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("details", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.create_index("ix_alerts_project_id", ["project_id"], unique=False)
        batch_op.create_index("ix_alerts_cluster_id", ["cluster_id"], unique=False)
        batch_op.create_index("ix_alerts_node_id", ["node_id"], unique=False)
        batch_op.create_index(
            "uq_alerts_open",
            ["node_id", "kind", "gpu", "subject"],
            unique=True,
            sqlite_where=sa.text("resolved_at IS NULL"),
            postgresql_where=sa.text("resolved_at IS NULL"),
        )

    op.create_table(
        "remediations",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("cluster_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("node_name", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("kinds", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=True),
        sa.Column("reviewed_by", sa.String(length=64), nullable=True),
        sa.Column("idempotency_key", sa.String(length=128), nullable=False),
        sa.Column("alert_ids", sa.Text(), nullable=False),
        sa.Column("health_run_ids", sa.Text(), nullable=False),
        sa.Column("step", sa.String(length=16), nullable=False),
        sa.Column("step_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("old_host_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        *(sa.Column(name, type_, nullable=True) for name, type_ in LEASE),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key"),
    )
    with op.batch_alter_table("remediations", schema=None) as batch_op:
        batch_op.create_index("ix_remediations_project_id", ["project_id"], unique=False)
        batch_op.create_index("ix_remediations_cluster_id", ["cluster_id"], unique=False)
        batch_op.create_index("ix_remediations_node_id", ["node_id"], unique=False)

    op.create_table(
        "health_runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("cluster_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("node_name", sa.String(length=64), nullable=False),
        sa.Column("check", sa.String(length=32), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("metrics", sa.Text(), nullable=False),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        *(sa.Column(name, type_, nullable=True) for name, type_ in LEASE),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("health_runs", schema=None) as batch_op:
        batch_op.create_index("ix_health_runs_project_id", ["project_id"], unique=False)
        batch_op.create_index("ix_health_runs_cluster_id", ["cluster_id"], unique=False)


def downgrade() -> None:
    op.drop_table("health_runs")
    op.drop_table("remediations")
    op.drop_table("alerts")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("gpu_backend")
        batch_op.drop_column("auto_repair")
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("repair_max_wait_s")
        batch_op.drop_column("repair_automatic")
