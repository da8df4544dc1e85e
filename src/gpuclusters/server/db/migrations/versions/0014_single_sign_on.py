"""Single sign-on: users' identity-provider subjects, expiring session keys,
sessions with their refresh tokens, console sign-ins under way

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 22:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sso_subject", sa.String(length=255), nullable=True))
        batch_op.create_unique_constraint(
            "uq_users_org_sso_subject", ["organization_id", "sso_subject"]
        )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "sso_sessions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("user_id", sa.String(length=32), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=False),
        sa.Column("via", sa.String(length=16), nullable=False),
        sa.Column("refresh_token", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sso_sessions_due", "sso_sessions", ["ended_at", "checked_at"])
    op.create_index(op.f("ix_sso_sessions_user_id"), "sso_sessions", ["user_id"])
    op.create_table(
        "sso_logins",
        sa.Column("state_hash", sa.String(length=64), nullable=False),
        sa.Column("verifier", sa.String(length=128), nullable=False),
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("state_hash"),
    )
    op.create_index(op.f("ix_sso_logins_created_at"), "sso_logins", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_sso_logins_created_at"), table_name="sso_logins")
    op.drop_table("sso_logins")
    op.drop_index(op.f("ix_sso_sessions_user_id"), table_name="sso_sessions")
    op.drop_index("ix_sso_sessions_due", table_name="sso_sessions")
    op.drop_table("sso_sessions")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("expires_at")
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_constraint("uq_users_org_sso_subject", type_="unique")
        batch_op.drop_column("sso_subject")
