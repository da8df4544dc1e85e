"""Organizations' SSH certificate authorities and members' keys, as the
controllers need them (the services build on the same helpers).

A CA is made on first use: two first uses racing end with one CA (the loser
of the insert reads the winner's). Private keys are stored in the database
(like the API key hashes, it is the service's secret store; see
docs/access.md).
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import sshca
from gpuclusters.server.db.dialects import upsert_insert
from gpuclusters.server.db.models import SshAuthority, SshKey, utcnow

CaKind = Literal["user", "host"]


async def org_authority(session: AsyncSession, organization_id: str, kind: CaKind) -> SshAuthority:
    """The organization's CA of this kind, created (and committed: a CA must
    never be made twice, and readers roll back) if new. Call it before
    writing anything else in the session."""
    found = await session.get(SshAuthority, (organization_id, kind))
    if found is not None:
        return found
    pair = sshca.new_keypair(f"gpuclusters {kind} CA")
    values = {
        "organization_id": organization_id,
        "kind": kind,
        "private_key": pair.private_openssh,
        "public_key": pair.public_openssh,
        "created_at": utcnow(),
    }
    # INSERT ... ON CONFLICT DO NOTHING: of two first uses, one row wins and
    # both read it (no savepoint needed, which SQLite's driver handles badly).
    await session.execute(
        upsert_insert(session, SshAuthority).values(**values).on_conflict_do_nothing()
    )
    await session.commit()
    found = await session.get(SshAuthority, (organization_id, kind), populate_existing=True)
    if found is None:  # pragma: no cover - inserted or already there: it exists
        raise RuntimeError(f"SSH {kind} CA of organization {organization_id} is missing")
    return found


async def live_keys(session: AsyncSession, user_ids: list[str]) -> dict[str, list[str]]:
    """Registered public keys (``"<type> <base64>"``) by user id."""
    out: dict[str, list[str]] = {u: [] for u in user_ids}
    if not user_ids:
        return out
    rows = await session.execute(
        select(SshKey.user_id, SshKey.public_key)
        .where(SshKey.user_id.in_(user_ids), SshKey.deleted_at.is_(None))
        .order_by(SshKey.created_at, SshKey.id)
    )
    for user_id, key in rows:
        out[user_id].append(key)
    return out
