"""Row leases: ``lock_owner``, ``lock_token``, ``lock_expires_at``.

* ``claim`` is a compare-and-set UPDATE that succeeds only if the row is
  unleased or its lease expired; it works the same on SQLite and PostgreSQL.
* ``fence`` is the first statement of every write-back transaction: it renews
  the lease only if our token still matches. Its UPDATE takes the row's write
  lock (PostgreSQL) or the database write lock (SQLite) until commit, so
  nobody can steal the row between the check and our write.
* ``fenced`` is ``fence`` that also loads the row, in the same statement
  (UPDATE ... RETURNING): the write-back that goes on to change the row
  needs no second query for it. It may write the change itself in that
  statement (``values``) and, for a pass's last write, give the lease back
  too (``release``): one statement where there were three.
* ``renew`` is the heartbeat: it pushes our lease's expiry out while a step
  runs (controllers/base.py), fenced by the token like every write.
* ``release`` clears the lease if it is still ours, and records the outcome
  of the work: a success clears ``retries``/``last_error``/``next_attempt_at``,
  a failure (``release_failed``) counts it and sets when to try again.
  ``claim`` does not take a row before its ``next_attempt_at``.
* ``release_dead_owners`` frees leases of processes on this machine that are
  gone (a server killed with -9), so a restart does not wait for expiry.
* ``hold_named`` / ``release_named``: the same compare-and-set on a row of
  ``controller_leases``, for work one replica does for all (housekeeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuclusters.server.db.models import (
    Cluster,
    ControllerLease,
    HealthRun,
    Node,
    Remediation,
    Volume,
    utcnow,
)

log = logging.getLogger(__name__)

Row = TypeVar("Row", Cluster, Node, Volume, Remediation, HealthRun)
LeasedModel = type[Cluster] | type[Node] | type[Volume] | type[Remediation] | type[HealthRun]
LEASED_MODELS: tuple[LeasedModel, ...] = (Cluster, Node, Volume, Remediation, HealthRun)


class LeaseLost(Exception):
    """Our lease on a row was taken over; stop working on it."""


def make_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _expiry(ttl_s: float) -> datetime:
    return utcnow() + timedelta(seconds=ttl_s)


def claimable(model: LeasedModel, now: datetime) -> tuple[ColumnElement[bool], ...]:
    """A row may be claimed when nobody's lease on it is live and its next
    attempt (after a failure) is due (also the rule for moving rows in bulk
    without a lease: ``NodeReconciler.batch_moves``)."""
    return (
        or_(model.lock_expires_at.is_(None), model.lock_expires_at < now),
        or_(model.next_attempt_at.is_(None), model.next_attempt_at <= now),
    )


async def claim(
    session: AsyncSession, model: LeasedModel, row_id: str, *, owner: str, ttl_s: float
) -> str | None:
    """Try to lease one row; return the token, or None if someone holds it."""
    token = secrets.token_hex(16)
    now = utcnow()
    result = await session.execute(
        update(model)
        .where(model.id == row_id, *claimable(model, now))
        .values(lock_owner=owner, lock_token=token, lock_expires_at=_expiry(ttl_s))
        .execution_options(synchronize_session=False)
    )
    await session.commit()
    return token if result.rowcount == 1 else None  # type: ignore[attr-defined]


async def claim_many(
    session: AsyncSession, model: LeasedModel, ids: list[str], *, owner: str, ttl_s: float
) -> dict[str, str]:
    """Lease every free row of ``ids`` in one statement; returns the claimed
    ids with their token (one token for the batch: fencing is by row id and
    token, so sharing it gives no row's holder another's)."""
    if not ids:
        return {}
    token = secrets.token_hex(16)
    now = utcnow()
    result = await session.execute(
        update(model)
        .where(model.id.in_(ids), *claimable(model, now))
        .values(lock_owner=owner, lock_token=token, lock_expires_at=_expiry(ttl_s))
        .returning(model.id)
        .execution_options(synchronize_session=False)
    )
    claimed = [str(row_id) for row_id in result.scalars()]
    await session.commit()
    return dict.fromkeys(claimed, token)


async def _extend(
    session: AsyncSession, model: LeasedModel, row_id: str, *, token: str, ttl_s: float
) -> bool:
    """Push our lease's expiry out, in the current transaction; False if
    the lease is not ours."""
    result = await session.execute(
        update(model)
        .where(model.id == row_id, model.lock_token == token)
        .values(lock_expires_at=_expiry(ttl_s))
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


async def fence(
    session: AsyncSession, model: LeasedModel, row_id: str, *, token: str, ttl_s: float
) -> None:
    """Renew our lease inside the current transaction, or raise ``LeaseLost``."""
    if not await _extend(session, model, row_id, token=token, ttl_s=ttl_s):
        raise LeaseLost(f"{model.__tablename__} {row_id}: lease lost")


# What giving a lease back after a step that succeeded writes (``release``).
_RELEASED: dict[str, object] = {"lock_owner": None, "lock_token": None, "lock_expires_at": None}
_SUCCEEDED: dict[str, object] = {"retries": 0, "last_error": None, "next_attempt_at": None}


async def fenced(
    session: AsyncSession,
    model: type[Row],
    row_id: str,
    *,
    token: str,
    ttl_s: float,
    values: Mapping[str, object] | None = None,
    release: bool = False,
) -> Row:
    """``fence``, returning the row (loaded into the session by the same
    statement, with ``values`` written by it too); raises ``LeaseLost`` if
    the lease is not ours. With ``release``, the same statement also gives
    the lease back as ``release(succeeded=True)`` would: for the last write
    of a pass, which then needs no transaction of its own to let go (the
    row stays locked against other writers until this transaction commits,
    so the write is still fenced)."""
    lease: dict[str, object] = (
        {**_RELEASED, **_SUCCEEDED} if release else {"lock_expires_at": _expiry(ttl_s)}
    )
    row = await session.scalar(
        update(model)
        .where(model.id == row_id, model.lock_token == token)
        .values({**(values or {}), **lease})
        .returning(model)
        .execution_options(populate_existing=True)
    )
    if row is None:
        raise LeaseLost(f"{model.__tablename__} {row_id}: lease lost")
    return row


async def renew(
    session: AsyncSession, model: LeasedModel, row_id: str, *, token: str, ttl_s: float
) -> bool:
    """Push our lease's expiry out (the heartbeat); False if it is not ours."""
    mine = await _extend(session, model, row_id, token=token, ttl_s=ttl_s)
    await session.commit()
    return mine


async def release(
    session: AsyncSession, model: LeasedModel, row_id: str, *, token: str, succeeded: bool = False
) -> None:
    """Give the lease up; after a step that succeeded, also clear the record
    of earlier failures (the same statement, so it costs nothing)."""
    values = {**_RELEASED, **(_SUCCEEDED if succeeded else {})}
    await session.execute(
        update(model)
        .where(model.id == row_id, model.lock_token == token)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    await session.commit()


async def release_failed(
    session: AsyncSession,
    model: LeasedModel,
    row_id: str,
    *,
    token: str,
    error: str,
    delay_s: Callable[[int], float],
) -> tuple[int, float] | None:
    """Give the lease up after a failed attempt: count it, keep its error and
    set when the next may start (``delay_s(retries)``). Returns the retries
    and the delay, or None if the lease was no longer ours."""
    retries = await session.scalar(
        select(model.retries).where(model.id == row_id, model.lock_token == token)
    )
    if retries is None:
        await session.rollback()
        return None
    retries += 1
    delay = delay_s(retries)
    await session.execute(
        update(model)
        .where(model.id == row_id, model.lock_token == token)
        .values(
            lock_owner=None,
            lock_token=None,
            lock_expires_at=None,
            retries=retries,
            last_error=error[:4000],
            next_attempt_at=utcnow() + timedelta(seconds=delay),
        )
        .execution_options(synchronize_session=False)
    )
    await session.commit()
    return retries, delay


async def hold_named(session: AsyncSession, name: str, *, owner: str, ttl_s: float) -> bool:
    """Take or renew the named lease for ``owner``; False while another
    owner holds it unexpired. Renewing is the same statement as taking, so a
    holder that stalls past its expiry simply loses it to the next claimant."""
    now = utcnow()
    result = await session.execute(
        update(ControllerLease)
        .where(ControllerLease.name == name)
        .where(
            or_(
                ControllerLease.owner == owner,
                ControllerLease.expires_at.is_(None),
                ControllerLease.expires_at < now,
            )
        )
        .values(owner=owner, token=secrets.token_hex(8), expires_at=_expiry(ttl_s))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        await session.commit()
        return True
    exists = await session.scalar(select(ControllerLease.name).where(ControllerLease.name == name))
    if exists is not None:
        await session.rollback()
        return False
    session.add(ControllerLease(name=name, owner=owner, expires_at=_expiry(ttl_s)))
    try:
        await session.commit()
    except IntegrityError:  # another replica made the row first: it holds it
        await session.rollback()
        return False
    return True


async def release_named(session: AsyncSession, name: str, *, owner: str) -> None:
    await session.execute(
        update(ControllerLease)
        .where(ControllerLease.name == name, ControllerLease.owner == owner)
        .values(owner=None, token=None, expires_at=None)
        .execution_options(synchronize_session=False)
    )
    await session.commit()


async def run_singleton(
    sessionmaker: async_sessionmaker[AsyncSession],
    name: str,
    *,
    interval_s: float,
    ttl_s: float,
    work: Callable[[], Awaitable[object]],
) -> None:
    """Loop until cancelled: ``work`` every ``interval_s`` while this
    process holds the named lease (one replica does it; when it dies the
    lease expires and another takes over), which it gives back when
    cancelled. A failure to take the lease skips that round."""
    owner = make_owner()
    try:
        while True:
            try:
                async with sessionmaker() as session:
                    held = await hold_named(session, name, owner=owner, ttl_s=ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: could not take its lease", name)
                held = False
            if held:
                await work()
            await asyncio.sleep(interval_s)
    finally:
        with contextlib.suppress(Exception):
            async with sessionmaker() as session:
                await release_named(session, name, owner=owner)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_here(owner: str) -> bool:
    """An owner that was a process of this host which is gone (or a previous
    incarnation of this very process id)."""
    host, _, rest = owner.partition(":")
    pid_s = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_s.isdigit():
        return False
    pid = int(pid_s)
    return pid == os.getpid() or not _pid_alive(pid)


async def release_dead_owners(session: AsyncSession) -> int:
    """Free leases held by dead processes of this host; return how many."""
    freed = 0
    named = (
        await session.execute(
            select(ControllerLease.name, ControllerLease.owner).where(
                ControllerLease.owner.is_not(None)
            )
        )
    ).all()
    for name, owner in named:
        if _dead_here(str(owner)):
            await release_named(session, name, owner=str(owner))
            freed += 1
    for model in LEASED_MODELS:
        rows = (
            await session.execute(
                select(model.id, model.lock_owner).where(model.lock_owner.is_not(None))
            )
        ).all()
        for row_id, owner in rows:
            if _dead_here(str(owner)):
                await session.execute(
                    update(model)
                    .where(model.id == row_id, model.lock_owner == owner)
                    .values(lock_owner=None, lock_token=None, lock_expires_at=None)
                    .execution_options(synchronize_session=False)
                )
                freed += 1
    await session.commit()
    return freed
