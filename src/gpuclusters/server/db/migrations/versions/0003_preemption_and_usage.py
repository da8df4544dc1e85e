"""preemption, usage, capacity windows, queued clusters

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("awaited_host_id", sa.String(length=32), nullable=True))
        batch_op.add_column(
            sa.Column("preempt_deadline", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(
            sa.Column("preempt_signalled", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.create_foreign_key(
            "fk_nodes_awaited_host_id_hosts", "hosts", ["awaited_host_id"], ["id"]
        )

    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("start_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("nodes_placed", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        batch_op.add_column(sa.Column("end_warned_for", sa.DateTime(timezone=True), nullable=True))

    op.create_table(
        "capacity_windows",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("gpu_type", sa.String(length=32), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("num_gpus", sa.Integer(), nullable=False),
        sa.Column("start_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("end_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("capacity_windows", schema=None) as batch_op:
        batch_op.create_index("ix_capacity_windows_name", ["name"], unique=False)
        batch_op.create_index("ix_capacity_windows_project_id", ["project_id"], unique=False)

    op.create_table(
        "usage_records",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("cluster_id", sa.String(length=32), nullable=False),
        sa.Column("cluster_name", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("node_name", sa.String(length=64), nullable=False),
        sa.Column("gpu_type", sa.String(length=32), nullable=False),
        sa.Column("compute_class", sa.String(length=16), nullable=False),
        sa.Column("billing", sa.String(length=16), nullable=False),
        sa.Column("num_gpus", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.create_index("ix_usage_records_project_id", ["project_id"], unique=False)
        batch_op.create_index("ix_usage_records_node_id", ["node_id"], unique=False)
        batch_op.create_index("ix_usage_records_started_at", ["started_at"], unique=False)


def downgrade() -> None:
    op.drop_table("usage_records")
    op.drop_table("capacity_windows")
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("end_warned_for")
        batch_op.drop_column("nodes_placed")
        batch_op.drop_column("start_at")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_constraint("fk_nodes_awaited_host_id_hosts", type_="foreignkey")
        batch_op.drop_column("preempt_signalled")
        batch_op.drop_column("preempt_deadline")
        batch_op.drop_column("awaited_host_id")
