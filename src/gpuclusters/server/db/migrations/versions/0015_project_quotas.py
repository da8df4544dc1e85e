"""Project quotas: standard and preemptible GPUs, clusters, TiB of volumes

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 22:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project_quotas",
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("standard_gpus", sa.Integer(), nullable=True),
        sa.Column("preemptible_gpus", sa.Integer(), nullable=True),
        sa.Column("clusters", sa.Integer(), nullable=True),
        sa.Column("volume_tib", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("project_id"),
    )


def downgrade() -> None:
    op.drop_table("project_quotas")
