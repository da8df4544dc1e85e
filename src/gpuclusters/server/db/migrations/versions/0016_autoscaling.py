"""Autoscaling: a cluster's range and idle time, a node's slot

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08 01:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(sa.Column("autoscale_min_gpus", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("autoscale_max_gpus", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("autoscale_idle_s", sa.Integer(), nullable=True))
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("slot", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("slot")
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("autoscale_idle_s")
        batch.drop_column("autoscale_max_gpus")
        batch.drop_column("autoscale_min_gpus")
