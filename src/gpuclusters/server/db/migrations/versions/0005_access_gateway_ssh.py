"""gateway ports and egress per cluster, SSH keys and SSH CAs

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 15:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = sa.text("deleted_at IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gateway_host", sa.String(length=253), nullable=True))
        batch_op.add_column(sa.Column("ssh_port", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("kubernetes_port", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("egress", sa.Boolean(), nullable=False, server_default=sa.true())
        )
    for column in ("ssh_port", "kubernetes_port"):
        op.create_index(
            f"uq_clusters_live_{column}",
            "clusters",
            [column],
            unique=True,
            sqlite_where=LIVE,
            postgresql_where=LIVE,
        )

    op.create_table(
        "ssh_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("user_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("key_type", sa.String(length=64), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_ssh_keys_user_id", "ssh_keys", ["user_id"])
    op.create_index(
        "uq_ssh_keys_live_fingerprint",
        "ssh_keys",
        ["user_id", "fingerprint"],
        unique=True,
        sqlite_where=LIVE,
        postgresql_where=LIVE,
    )
    op.create_table(
        "ssh_authorities",
        sa.Column("organization_id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("private_key", sa.Text(), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["organization_id"], ["organizations.id"]),
        sa.PrimaryKeyConstraint("organization_id", "kind"),
    )


def downgrade() -> None:
    op.drop_table("ssh_authorities")
    op.drop_index("uq_ssh_keys_live_fingerprint", table_name="ssh_keys")
    op.drop_index("ix_ssh_keys_user_id", table_name="ssh_keys")
    op.drop_table("ssh_keys")
    for column in ("ssh_port", "kubernetes_port"):
        op.drop_index(f"uq_clusters_live_{column}", table_name="clusters")
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("egress")
        batch_op.drop_column("kubernetes_port")
        batch_op.drop_column("ssh_port")
        batch_op.drop_column("gateway_host")
