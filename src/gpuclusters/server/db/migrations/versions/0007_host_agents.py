"""Hosts with host agents: agent state, address, heartbeat, inventory, credentials; join tokens

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_status", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("address", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("agent_port", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("inventory", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("secret_hash", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("cert_fingerprint", sa.String(length=128), nullable=True))
    op.create_table(
        "host_join_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("host_name", sa.String(length=64), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("ib_island", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )


def downgrade() -> None:
    op.drop_table("host_join_tokens")
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        for column in (
            "cert_fingerprint",
            "secret_hash",
            "inventory",
            "last_heartbeat_at",
            "agent_port",
            "address",
            "agent_status",
        ):
            batch_op.drop_column(column)
