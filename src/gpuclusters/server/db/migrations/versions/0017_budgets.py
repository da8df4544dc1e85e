"""Budgets: a project's monthly or credit budget, its policy and alerts; usage by user

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-08 01:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project_budgets",
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("amount", sa.Float(), nullable=False),
        sa.Column("policy", sa.String(length=16), nullable=False),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("credit_since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("alert_period", sa.String(length=40), nullable=False),
        sa.Column("alerted_percent", sa.Integer(), nullable=False),
        sa.Column("exhausted_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("enforced", sa.String(length=16), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("project_id"),
    )
    op.create_table(
        "budget_alerts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("percent", sa.Integer(), nullable=False),
        sa.Column("spent", sa.Float(), nullable=False),
        sa.Column("amount", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_budget_alerts_project_time", "budget_alerts", ["project_id", "timestamp"])
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(
            sa.Column("user_name", sa.String(length=64), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("user_name")
    op.drop_index("ix_budget_alerts_project_time", table_name="budget_alerts")
    op.drop_table("budget_alerts")
    op.drop_table("project_budgets")
