"""Scale: indexes for the controllers' and lists' queries, controller leases

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 22:45:13.505970
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "controller_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("token", sa.String(length=64), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.create_index(
            "ix_clusters_live_status",
            ["status"],
            unique=False,
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )
        batch_op.create_index(
            "ix_clusters_project_created", ["project_id", "created_at", "name"], unique=False
        )

    with op.batch_alter_table("health_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_health_runs_state"), ["state"], unique=False)

    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.create_index(
            "ix_hosts_kind", ["gpu_type", "region", "ib_island", "name"], unique=False
        )

    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.create_index(
            "ix_nodes_live_awaited_host",
            ["awaited_host_id"],
            unique=False,
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )
        batch_op.create_index(
            "ix_nodes_live_phase",
            ["phase"],
            unique=False,
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )
        batch_op.create_index(
            "ix_nodes_project_created", ["project_id", "created_at", "name"], unique=False
        )

    with op.batch_alter_table("remediations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_remediations_state"), ["state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("remediations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_remediations_state"))

    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_index("ix_nodes_project_created")
        batch_op.drop_index(
            "ix_nodes_live_phase",
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )
        batch_op.drop_index(
            "ix_nodes_live_awaited_host",
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )

    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_index("ix_hosts_kind")

    with op.batch_alter_table("health_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_health_runs_state"))

    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_index("ix_clusters_project_created")
        batch_op.drop_index(
            "ix_clusters_live_status",
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )

    op.drop_table("controller_leases")
