"""Indexes for paging the host list and a project's node events

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 18:50:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.create_index("ix_hosts_created", ["created_at", "name"], unique=False)
    with op.batch_alter_table("node_events", schema=None) as batch_op:
        batch_op.create_index(
            "ix_node_events_project_time", ["project_id", "timestamp", "node_name"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("node_events", schema=None) as batch_op:
        batch_op.drop_index("ix_node_events_project_time")
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_index("ix_hosts_created")
