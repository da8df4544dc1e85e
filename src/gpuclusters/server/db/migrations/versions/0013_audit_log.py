"""The audit log: one row per mutating API call or console action

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 22:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("organization_id", sa.String(length=32), nullable=True),
        sa.Column("user_id", sa.String(length=32), nullable=True),
        sa.Column("user_name", sa.String(length=64), nullable=False),
        sa.Column("via", sa.String(length=16), nullable=False),
        sa.Column("address", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("route", sa.String(length=200), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=True),
        sa.Column("project_name", sa.String(length=64), nullable=False),
        sa.Column("object", sa.String(length=300), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_time", "audit_events", ["timestamp", "user_name", "id"])
    op.create_index("ix_audit_project_time", "audit_events", ["project_id", "timestamp"])
    op.create_index("ix_audit_user_time", "audit_events", ["user_name", "timestamp"])


def downgrade() -> None:
    op.drop_index("ix_audit_user_time", table_name="audit_events")
    op.drop_index("ix_audit_project_time", table_name="audit_events")
    op.drop_index("ix_audit_time", table_name="audit_events")
    op.drop_table("audit_events")
