"""Outcomes on the row: retries, last error, next attempt; phase deadlines;
when a cluster's control plane came up; forced deletes

Every leased table gets ``retries``, ``last_error`` and ``next_attempt_at``
(the reconcile engine's backoff, formerly in process memory). Nodes and
clusters get ``phase_deadline_at``. Clusters get ``control_plane_ready_at``
(filled for clusters whose history shows the control plane came up) and
``force_delete_reason``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 03:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEASED = ("volumes", "clusters", "nodes", "remediations", "health_runs")
# Statuses a cluster reaches only after its control plane came up.
_PAST_CONTROL_PLANE = (
    "waiting_for_volume",
    "waiting_for_nodes",
    "running_acceptance_tests",
    "ready",
    "degraded",
)


def upgrade() -> None:
    for table in LEASED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("retries", sa.Integer(), server_default="0", nullable=False)
            )
            batch_op.add_column(sa.Column("last_error", sa.Text(), nullable=True))
            batch_op.add_column(
                sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True)
            )
    for table in ("clusters", "nodes"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("phase_deadline_at", sa.DateTime(timezone=True), nullable=True)
            )
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("control_plane_ready_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("force_delete_reason", sa.Text(), nullable=True))
    statuses = ", ".join(f"'{s}'" for s in _PAST_CONTROL_PLANE)
    op.execute(
        "UPDATE clusters SET control_plane_ready_at = ("
        "SELECT min(p.timestamp) FROM cluster_phases p "
        f"WHERE p.cluster_id = clusters.id AND p.phase IN ({statuses}))"
    )


def downgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("force_delete_reason")
        batch_op.drop_column("control_plane_ready_at")
    for table in ("clusters", "nodes"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("phase_deadline_at")
    for table in LEASED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("next_attempt_at")
            batch_op.drop_column("last_error")
            batch_op.drop_column("retries")
