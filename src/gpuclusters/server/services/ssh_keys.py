"""Users' SSH public keys: register, list, delete (``/v1/ssh-keys``).

A key belongs to its user alone: nobody, organization admins included,
sees or deletes another user's keys (another user's key answers 404, like
one that does not exist). A delete only sets ``deleted_at``; the access
sync removes the key from nodes. Every change wakes the access sync and
returns once it has pushed the change (``access_changes``).
Keys are validated by ``core.sshca.parse_public_key`` and stored without
their comment; the comment becomes the default name.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core import sshca
from gpuclusters.core.errors import (
    AlreadyExistsError,
    InvalidStateError,
    NotFoundError,
    ValidationError,
)
from gpuclusters.server.db.models import SshKey
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.access_changes import access_changed

log = logging.getLogger(__name__)

MAX_KEYS_PER_USER = 50


def parse_key(text: str) -> sshca.PublicKey:
    """The key, or ``invalid_input`` naming ``public_key`` and the rule."""
    try:
        return sshca.parse_public_key(text)
    except sshca.SshKeyError as exc:
        raise ValidationError(f"public_key: {exc}", field="public_key") from exc


def default_name(key: sshca.PublicKey, name: str | None) -> str:
    """The name given, else the key's comment (cut to the column's size)."""
    if name:
        return name
    return key.comment.strip()[: api.SSH_KEY_NAME_MAX]


def key_view(row: SshKey) -> api.SshKey:
    return api.SshKey(
        id=row.id,
        name=row.name,
        key_type=row.key_type,
        fingerprint=row.fingerprint,
        public_key=row.public_key,
        created_at=row.created_at,
    )


async def _live(session: AsyncSession, user_id: str, fingerprint: str) -> SshKey | None:
    return await session.scalar(
        select(SshKey).where(
            SshKey.user_id == user_id,
            SshKey.fingerprint == fingerprint,
            SshKey.deleted_at.is_(None),
        )
    )


async def list_keys(session: AsyncSession, *, principal: Principal) -> list[api.SshKey]:
    rows = await session.scalars(
        select(SshKey)
        .where(SshKey.user_id == principal.user_id, SshKey.deleted_at.is_(None))
        .order_by(SshKey.created_at, SshKey.id)
    )
    return [key_view(r) for r in rows]


async def add_key(
    session: AsyncSession, *, rt: Runtime, principal: Principal, body: api.SshKeyCreate
) -> api.SshKey:
    key = parse_key(body.public_key)
    existing = await _live(session, principal.user_id, key.fingerprint)
    if existing is not None:
        raise AlreadyExistsError(
            f"you already have this key ({key.fingerprint}) as {existing.name or existing.id!r}",
            field="public_key",
        )
    count = await session.scalar(
        select(func.count())
        .select_from(SshKey)
        .where(SshKey.user_id == principal.user_id, SshKey.deleted_at.is_(None))
    )
    if (count or 0) >= MAX_KEYS_PER_USER:
        raise InvalidStateError(
            f"you have {count} SSH keys, the most one user may have; delete one first"
        )
    row = SshKey(
        user_id=principal.user_id,
        name=default_name(key, body.name),
        key_type=key.key_type,
        public_key=key.openssh,
        fingerprint=key.fingerprint,
    )
    session.add(row)
    try:
        await session.commit()
    except IntegrityError:  # the same key added twice at once
        await session.rollback()
        raise AlreadyExistsError(
            f"you already have this key ({key.fingerprint})", field="public_key"
        ) from None
    await access_changed(rt)
    log.info(
        "ssh key added: user=%s id=%s type=%s fingerprint=%s",
        principal.user_name,
        row.id,
        row.key_type,
        row.fingerprint,
    )
    return key_view(row)


async def delete_key(
    session: AsyncSession, *, rt: Runtime, principal: Principal, key_ref: str
) -> None:
    """Delete one of the caller's live keys, named by id or fingerprint
    (with or without the ``SHA256:`` prefix)."""
    ref = key_ref.strip()
    if not ref or len(ref) > 128 or not ref.isprintable():
        raise NotFoundError(f"SSH key {key_ref!r} not found", field="id")
    fingerprints = [ref] if ref.startswith("SHA256:") else [ref, f"SHA256:{ref}"]
    row = await session.scalar(
        select(SshKey).where(
            SshKey.user_id == principal.user_id,
            SshKey.deleted_at.is_(None),
            or_(SshKey.id == ref, SshKey.fingerprint.in_(fingerprints)),
        )
    )
    if row is None:
        raise NotFoundError(f"SSH key {key_ref!r} not found", field="id")
    row.deleted_at = datetime.now(UTC)
    await session.commit()
    await access_changed(rt)
    log.info(
        "ssh key deleted: user=%s id=%s fingerprint=%s",
        principal.user_name,
        row.id,
        row.fingerprint,
    )
