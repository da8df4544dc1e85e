"""Budgets, as pure rules (docs/budgets.md).

A project's budget is money per calendar month (UTC) or a prepaid credit
balance, spent by its usage at the operator's prices (core/pricing.py).
Alerts go out once per period at 50, 80 and 100 % of it; once it is spent
and the grace period has passed, the project's policy holds:

- ``pause``: preemptible targets go to 0 and no new node is placed (creates,
  scale-ups, autoscaling are refused); running standard nodes stay;
- ``stop``: every node is released and clusters wait ``suspended`` with their
  volumes and control planes; they resume when credit returns.

Nothing a budget does deletes a cluster, a volume or any data.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

THRESHOLDS: tuple[int, ...] = (50, 80, 100)


class BudgetKind(StrEnum):
    MONTHLY = "monthly"
    CREDIT = "credit"


class BudgetPolicy(StrEnum):
    PAUSE = "pause"
    STOP = "stop"


def period_start(kind: BudgetKind, *, now: datetime, credit_since: datetime) -> datetime:
    """Where the spending counted against the budget starts: the month's
    first instant, or when the credit was last set."""
    if kind is BudgetKind.MONTHLY:
        return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return credit_since


def period_key(kind: BudgetKind, *, now: datetime, credit_since: datetime) -> str:
    """Alerts go out once per key: the month, or the credit's start."""
    return period_start(kind, now=now, credit_since=credit_since).isoformat()


def percent_spent(spent: float, amount: float) -> float:
    if amount <= 0:
        return 100.0
    return 100.0 * spent / amount


def new_alerts(spent: float, amount: float, *, already: int) -> list[int]:
    """Thresholds crossed now that were not alerted in this period
    (``already``: the highest one alerted)."""
    pct = percent_spent(spent, amount)
    return [t for t in THRESHOLDS if already < t <= pct]


@dataclass(frozen=True, slots=True)
class Enforcement:
    """What the project's policy asks for now."""

    enforce: BudgetPolicy | None  # None: nothing held back
    exhausted_since: datetime | None
    grace_ends_at: datetime | None


def enforcement(
    *,
    spent: float,
    amount: float,
    policy: BudgetPolicy,
    exhausted_since: datetime | None,
    now: datetime,
    grace: timedelta,
) -> Enforcement:
    """Exhausted from the first look at 100 % on; the policy holds once the
    grace period has passed; credit back under 100 % (a new month, a
    top-up, a higher amount) lifts it."""
    if percent_spent(spent, amount) < 100:
        return Enforcement(enforce=None, exhausted_since=None, grace_ends_at=None)
    since = exhausted_since or now
    ends = since + grace
    return Enforcement(
        enforce=policy if now >= ends else None, exhausted_since=since, grace_ends_at=ends
    )
