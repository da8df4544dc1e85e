"""Projects' host id blocks (the user namespaces of their nodes)

Existing projects get blocks 0, 1, 2 ... in the order they were made.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 14:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.add_column(sa.Column("id_block", sa.Integer(), nullable=True))
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id FROM projects ORDER BY created_at, id")).all()
    for index, (project_id,) in enumerate(rows):
        conn.execute(
            sa.text("UPDATE projects SET id_block = :i WHERE id = :p"),
            {"i": index, "p": project_id},
        )
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.alter_column("id_block", existing_type=sa.Integer(), nullable=False)
        batch_op.create_unique_constraint("uq_projects_id_block", ["id_block"])


def downgrade() -> None:
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_constraint("uq_projects_id_block", type_="unique")
        batch_op.drop_column("id_block")
