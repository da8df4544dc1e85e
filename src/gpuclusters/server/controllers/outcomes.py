"""What one controller step says happened (kopf's handler outcomes, in small).

A step returns one of:

* ``MOVED``: it wrote a change; take the next step at once;
* ``WAIT``: nothing to do until something else happens (a hint or the poll);
* ``retry(error)``: a temporary failure; the engine records it on the row
  (``retries``, ``last_error``, ``next_attempt_at``) and tries again after
  the backoff (or ``delay_s``);
* ``fail(reason)``: a permanent failure; the reconciler moves the row to its
  failed state with the reason.

A step may also raise: ``PermanentLayerError``/``PermanentProviderError``
count as ``fail``, anything else as ``retry``. ``moved`` names the phases a
write moved the row between, so a reconciler can tell others (a node's
cluster counts running and failed nodes) without state kept between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuclusters.layers.base import PermanentLayerError
from gpuclusters.providers.base import PermanentProviderError

Kind = Literal["moved", "wait", "retry", "fail"]


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    error: str = ""
    delay_s: float | None = None
    moved: tuple[str, str] | None = None  # (from, to) phases of a write
    parent: str | None = None  # the row's owner a move may concern (a node's cluster)
    settled: bool = False  # moved to where nothing more is to do now: end the pass
    released: bool = False  # the write gave the lease back too (``leases.fenced``)

    @property
    def changed(self) -> bool:
        return self.kind in ("moved", "fail")


MOVED = Outcome("moved")
WAIT = Outcome("wait")


def moved(
    before: str,
    after: str,
    *,
    parent: str | None = None,
    settled: bool = False,
    released: bool = False,
) -> Outcome:
    """A write moved the row; ``released``: it gave the lease back as well,
    which ends the pass (the engine has no lease left to give back)."""
    return Outcome(
        "moved",
        moved=(before, after),
        parent=parent,
        settled=settled or released,
        released=released,
    )


def retry(error: str, *, delay_s: float | None = None) -> Outcome:
    return Outcome("retry", error=error, delay_s=delay_s)


def fail(reason: str) -> Outcome:
    return Outcome("fail", error=reason)


def of(changed: bool) -> Outcome:
    """The outcome of a write helper that says whether it changed anything."""
    return MOVED if changed else WAIT


def from_exception(exc: BaseException) -> Outcome:
    """A step's exception as an outcome: permanent errors fail the row."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, PermanentLayerError | PermanentProviderError):
        return fail(text)
    return retry(f"{type(exc).__name__}: {text}" if not str(exc) else text)


@dataclass(frozen=True, slots=True)
class Released:
    """What a pass returns when its last write gave the lease back (instead
    of a bool): the engine then releases nothing. True if the pass changed
    the row, like the bool it stands for."""

    changed: bool

    def __bool__(self) -> bool:
        return self.changed


class StepFailed(Exception):
    """A step's temporary failure on its way to the engine, which records it."""

    def __init__(self, error: str, delay_s: float | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.delay_s = delay_s
