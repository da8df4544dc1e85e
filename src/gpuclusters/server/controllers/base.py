"""The reconciler loop shared by every controller.

One loop per reconciler: wait for a hint or the poll interval, list the rows
that need work, claim free ones with a lease and run ``reconcile`` on each
in its own task (at most ``concurrency`` at once, one task per row).
``stop`` cancels the loop and waits for running tasks, so shutdown never
leaves a half-written step (every step is idempotent anyway).

Leases cannot run out under a step: while a row is claimed, a heartbeat
renews its lease every third of the TTL, fenced by the token. If a renewal
finds the lease gone (or cannot renew it before it expires: a stalled
process), the step is cancelled, and every write it had left is fenced
anyway, so it writes nothing after another replica took the row.

Outcomes live on the row, not in this process: a step that fails
temporarily has its error, its count (``retries``) and the time of the next
attempt (``next_attempt_at``, exponential backoff with a cap) recorded as it
releases the lease; ``claim`` takes no row before that time, whichever
replica asks, and a restart goes on with the same backoff. A step that
succeeds clears them in its release. A pass whose last write gives the
lease back itself (``leases.fenced(release=True)``, returning ``Released``)
saves that transaction: the engine then has nothing to release. A permanent error goes to the
reconciler's ``fail`` (a node or cluster fails with the reason).

A pass claims only as many rows as it can start now (twice the concurrency,
so the next is ready when one finishes), in one statement per batch: a lease is held while work is
done, not while it waits its turn, so a burst of thousands of rows neither
outlives its leases nor keeps other replicas from the rows this one cannot
reach yet. The next pass starts after the last row claimed (round robin, in
the reconciler's ``rank`` order: nodes oldest first, so in a burst the first
cluster's nodes are served first and it is ready first, not all clusters at
the end), so rows that wait on something slow do not starve the rest. What
a pass found no room for waits in a queue, in order; each task that ends
hands the next rows of it to a targeted pass, so a burst of thousands costs
a query for a few ids per step started, not a scan of every candidate.

Passes are *full* (every candidate) when the poll interval has passed since
the last full one or a hint asked for one; a hint that names rows
(``Hints.notify_rows``: a node moved, so its cluster may move) runs a
*targeted* pass over just the named candidates. So the cost of a change is
the rows it touches, not every row waiting for something, and the periodic
full pass still catches what no hint announced (another replica's work).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuclusters.core.deadlines import backoff_s
from gpuclusters.layers.base import LayerError
from gpuclusters.providers.base import ProviderError
from gpuclusters.server.controllers import leases, outcomes
from gpuclusters.server.controllers.hints import Hints
from gpuclusters.server.controllers.outcomes import Outcome, Released, StepFailed

log = logging.getLogger(__name__)

STEPS = Counter("gpuclusters_reconcile_steps_total", "Reconcile runs", ["controller", "result"])
STEP_SECONDS = Histogram("gpuclusters_reconcile_seconds", "Reconcile run time", ["controller"])
QUEUED = Gauge(
    "gpuclusters_reconcile_queue",
    "Rows that need work and found no room in the last pass",
    ["controller"],
)
INFLIGHT = Gauge("gpuclusters_reconcile_inflight", "Steps running now", ["controller"])
CANDIDATES = Gauge(
    "gpuclusters_reconcile_candidates", "Rows that needed work at the last pass", ["controller"]
)
LAST_FULL_PASS = Gauge(
    "gpuclusters_reconcile_last_full_pass_timestamp_seconds",
    "When the last full pass ran (lag: time() minus this)",
    ["controller"],
)


@dataclass(frozen=True, slots=True)
class ControllerContext:
    sessionmaker: async_sessionmaker[AsyncSession]
    hints: Hints
    owner: str
    lease_ttl_s: float
    interval_s: float
    concurrency: int
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0


class Reconciler(ABC):
    name: str
    model: leases.LeasedModel

    def __init__(self, ctx: ControllerContext) -> None:
        self.ctx = ctx
        self._inflight: dict[str, asyncio.Task[None]] = {}
        # When rows that failed may be tried again: a cache of their
        # ``next_attempt_at`` so a pass does not try to claim them early
        # (``claim`` refuses them anyway; the row is the truth).
        self._retry_at: dict[str, float] = {}
        self._sem = asyncio.Semaphore(ctx.concurrency)
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_rank: tuple[Any, ...] = ()  # where the next pass starts (round robin)
        # Candidates the last passes found no room for, in order (see run_once).
        self._queue: collections.deque[str] = collections.deque()
        self._last_full = float("-inf")  # when the last full pass ran
        self._deferred: set[str] = set()  # hinted while in flight: look again after
        # Whether this pass was asked for by a full hint (``Hints.notify``:
        # "something changed, look at everything"), not only due by the
        # poll interval; ``candidates`` may look wider then.
        self.full_pass_asked = False

    @abstractmethod
    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        """Ids of rows that need work now."""

    async def batch_moves(self, session: AsyncSession, among: set[str] | None) -> None:
        """Before a pass looks for candidates: moves that need no step of
        their own (no side effect, nothing to ask anyone), made for many
        rows in one statement, among ``among`` (a targeted pass) or all.
        Only on rows nobody holds (``leases.claimable``); none by default."""
        del session, among

    # Seconds a woken loop waits for more hints before its pass (0: none).
    gather_s = 0.0

    def rank(self, row_id: str) -> tuple[Any, ...]:
        """A candidate's place in the round: by id, unless a reconciler
        knows better (nodes go oldest first, so the first cluster of a burst
        is served first rather than every cluster a little)."""
        return (row_id,)

    async def candidates_among(self, session: AsyncSession, ids: set[str]) -> Sequence[str]:
        """The candidates among ``ids`` (a targeted pass). Reconcilers with
        many rows override it with a query that filters by id, so a pass
        for a few rows costs a few rows."""
        return [row_id for row_id in await self.candidates(session) if row_id in ids]

    @abstractmethod
    async def reconcile(self, row_id: str, token: str) -> bool | Released:
        """Advance one row; return True if it changed (look again soon), or
        ``Released`` if its last write gave the lease back. Raise
        ``StepFailed`` (or anything) for a temporary failure."""

    async def fail(self, row_id: str, token: str, reason: str) -> None:
        """A permanent error: move the row to its failed state. Reconcilers
        whose rows can fail override it; by default it is retried like a
        temporary one."""
        raise StepFailed(reason)

    # -- loop ----------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._guarded_loop(), name=f"reconciler-{self.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def _guarded_loop(self) -> None:
        while not self._stopping:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any bug in one pass
                log.exception("reconciler %s: loop crashed; restarting in 1s", self.name)
                await asyncio.sleep(1)

    async def _loop(self) -> None:
        while not self._stopping:
            await self.run_once()
            await self.ctx.hints.wait(self.name, self.ctx.interval_s)
            if self.gather_s:
                # Let the hints that come together make one pass (ten nodes
                # of a cluster going live wake it once, not ten times).
                await asyncio.sleep(self.gather_s)

    async def run_once(self) -> None:
        """One pass: claim and start work on candidate rows, up to the room
        there is (see the module docstring)."""
        full_hint, hinted = self.ctx.hints.take(self.name)
        now = time.monotonic()
        full = full_hint or not hinted or now - self._last_full >= self.ctx.interval_s
        self.full_pass_asked = full_hint
        async with self.ctx.sessionmaker() as session:
            await self.batch_moves(session, None if full else hinted)
            if full:
                found = set(await self.candidates(session))
                # A full pass may leave out rows that only hints bring in
                # (clusters waiting for their nodes): the hinted ones count.
                if hinted - found:
                    found |= set(await self.candidates_among(session, hinted - found)) & hinted
            else:
                found = set(await self.candidates_among(session, hinted)) & hinted
        if full:
            self._last_full = now
            LAST_FULL_PASS.labels(self.name).set_to_current_time()
        CANDIDATES.labels(self.name).set(len(found))
        ids = sorted(found, key=self.rank)
        # Round robin: start after the row claimed last.
        start = next((i for i, row_id in enumerate(ids) if self.rank(row_id) > self._last_rank), 0)
        room = 2 * self.ctx.concurrency
        eligible = []
        for row_id in ids[start:] + ids[:start]:
            if row_id in self._inflight:
                self._deferred.add(row_id)  # it may have changed again meanwhile
            elif self._retry_at.get(row_id, 0) <= now:
                eligible.append(row_id)
        # Claim in batches of the room left (one statement each), until the
        # room is full or no candidate is left; rows others hold are skipped.
        while eligible:
            free = room - len(self._inflight)
            if free <= 0:
                break
            batch, eligible = eligible[:free], eligible[free:]
            async with self.ctx.sessionmaker() as session:
                claimed = await leases.claim_many(
                    session, self.model, batch, owner=self.ctx.owner, ttl_s=self.ctx.lease_ttl_s
                )
            for row_id in batch:  # in round-robin order
                token = claimed.get(row_id)
                if token is not None:
                    self._last_rank = self.rank(row_id)
                    self._inflight[row_id] = asyncio.create_task(self._work(row_id, token))
        # What found no room waits in the queue, in order: each task that
        # ends hands the next ones to a targeted pass (a query for a few ids)
        # rather than a full pass, which with thousands of candidates cost
        # more than the steps it started. Rows queued before stay queued
        # behind them, after a full pass too: a full pass may not list a
        # row that a hint brought in (see ``candidates``), and a row that
        # needs nothing any more is dropped by the targeted pass it reaches.
        if eligible or full:
            waiting = set(eligible)
            self._queue = collections.deque(
                [
                    *eligible,
                    *(
                        row_id
                        for row_id in self._queue
                        if row_id not in waiting and row_id not in self._inflight
                    ),
                ]
            )
        QUEUED.labels(self.name).set(len(self._queue))
        INFLIGHT.labels(self.name).set(len(self._inflight))

    async def work_on(self, row_id: str) -> bool:
        """Claim one row and run a pass on it exactly as the loop would
        (heartbeat, outcome recorded on the row, lease released); False if
        the row could not be claimed (leased, or before its next attempt).
        For tests and tools that drive one row."""
        async with self.ctx.sessionmaker() as session:
            token = await leases.claim(
                session, self.model, row_id, owner=self.ctx.owner, ttl_s=self.ctx.lease_ttl_s
            )
        if token is None:
            return False
        task = self._inflight[row_id] = asyncio.create_task(self._work(row_id, token))
        await task
        return True

    async def _work(self, row_id: str, token: str) -> None:
        changed = False
        # A hint that arrives while this row is being worked on wakes a pass
        # that skips the row (it is in flight); remember to look again.
        hints_before = self.ctx.hints.count(self.name)
        step = asyncio.create_task(self._guarded_reconcile(row_id, token))
        lost = asyncio.Event()
        beat = asyncio.create_task(self._heartbeat(row_id, token, step, lost))
        succeeded = released = False
        failure: StepFailed | None = None
        try:
            result = await step
            released, changed = isinstance(result, Released), bool(result)
            succeeded = True
            STEPS.labels(self.name, "ok").inc()
        except asyncio.CancelledError:
            if not lost.is_set():
                # We are being cancelled (shutdown): so is the step, and the
                # lease is given back below (the step's writes are fenced).
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise
            STEPS.labels(self.name, "lease_lost").inc()
            log.warning(
                "reconciler %s: lease on %s lost during a step; cancelled", self.name, row_id
            )
        except leases.LeaseLost:
            STEPS.labels(self.name, "lease_lost").inc()
        except StepFailed as exc:
            STEPS.labels(self.name, "error").inc()
            failure = exc
        except Exception as exc:  # from ``fail`` itself: retried like any error
            STEPS.labels(self.name, "error").inc()
            log.exception("reconciler %s: %s could not be failed", self.name, row_id)
            failure = StepFailed(f"{type(exc).__name__}: {exc}")
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
            if not lost.is_set() and not released:
                await self._give_back(row_id, token, succeeded=succeeded, failure=failure)
            self._inflight.pop(row_id, None)
        if succeeded:
            self._retry_at.pop(row_id, None)
        look_again = changed or row_id in self._deferred
        self._deferred.discard(row_id)
        if self._stopping:
            return
        rows = [row_id] if look_again else []
        # The next rows waiting for room (two, in case one is gone by now).
        for _ in range(min(2, len(self._queue))):
            rows.append(self._queue.popleft())
        if self.ctx.hints.count(self.name) != hints_before:
            self.ctx.hints.notify(self.name)  # a full pass was asked meanwhile
        if rows:
            self.ctx.hints.notify_rows(self.name, rows)

    async def _guarded_reconcile(self, row_id: str, token: str) -> bool | Released:
        """``reconcile`` under the concurrency limit, any exception but a
        lost lease turned into ``StepFailed`` (permanent ones through
        ``fail``)."""
        async with self._sem:
            with STEP_SECONDS.labels(self.name).time():
                try:
                    return await self.reconcile(row_id, token)
                except (leases.LeaseLost, StepFailed, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    outcome = outcomes.from_exception(exc)
                    if outcome.kind != "fail":
                        if not isinstance(exc, LayerError | ProviderError):
                            # Not a failure a layer or provider reported:
                            # maybe a bug; keep its traceback.
                            log.exception("reconciler %s: %s failed", self.name, row_id)
                        raise StepFailed(outcome.error) from exc
                await self.fail(row_id, token, outcome.error)
                return True

    async def _heartbeat(
        self, row_id: str, token: str, step: asyncio.Task[bool | Released], lost: asyncio.Event
    ) -> None:
        """Renew the lease every TTL/3 while ``step`` runs; cancel the step
        if the lease is gone, or if it could not be renewed before expiry."""
        ttl = self.ctx.lease_ttl_s
        loop = asyncio.get_running_loop()
        expires = loop.time() + ttl
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                async with self.ctx.sessionmaker() as session:
                    mine = await leases.renew(session, self.model, row_id, token=token, ttl_s=ttl)
            except asyncio.CancelledError:
                raise
            except Exception:  # the database is away: try again, until expiry
                log.warning("reconciler %s: could not renew the lease on %s", self.name, row_id)
                mine = loop.time() < expires - ttl / 6
            else:
                if mine:
                    expires = loop.time() + ttl
            if not mine:
                lost.set()
                step.cancel()
                return

    async def _give_back(
        self, row_id: str, token: str, *, succeeded: bool, failure: StepFailed | None
    ) -> None:
        try:
            async with self.ctx.sessionmaker() as session:
                if failure is None:
                    await leases.release(
                        session, self.model, row_id, token=token, succeeded=succeeded
                    )
                    return
                fixed = failure.delay_s
                recorded = await leases.release_failed(
                    session,
                    self.model,
                    row_id,
                    token=token,
                    error=failure.error,
                    delay_s=lambda n: (
                        fixed
                        if fixed is not None
                        else backoff_s(
                            n, base_s=self.ctx.backoff_base_s, cap_s=self.ctx.backoff_cap_s
                        )
                    ),
                )
        except Exception:
            log.exception("reconciler %s: could not release lease on %s", self.name, row_id)
            return
        if recorded is not None:
            retries, delay = recorded
            self._retry_at[row_id] = time.monotonic() + delay
            log.warning(
                "reconciler %s: %s failed (attempt %d): %s; retry in %.1fs",
                self.name,
                row_id,
                retries,
                failure.error,
                delay,
            )


class SteppedReconciler(Reconciler):
    """A reconciler that advances a row by small transitions: ``step`` makes
    one and returns its ``Outcome`` (a bool is read as moved/wait); a pass
    takes up to ``max_steps_per_pass`` of them while the lease is held, so a
    row moves through quick phases without waiting for the next poll.
    ``settled`` sees every outcome of the pass (to tell other controllers
    what moved)."""

    max_steps_per_pass = 8

    @abstractmethod
    async def step(self, row_id: str, token: str) -> Outcome | bool:
        """One idempotent transition."""

    async def settled(self, row_id: str, taken: list[Outcome]) -> None:
        """Called after a pass's steps (also when one failed)."""

    async def reconcile(self, row_id: str, token: str) -> bool | Released:
        taken: list[Outcome] = []
        try:
            for _ in range(self.max_steps_per_pass):
                result = await self.step(row_id, token)
                outcome = outcomes.of(result) if isinstance(result, bool) else result
                if outcome.kind == "fail":
                    await self.fail(row_id, token, outcome.error)
                elif outcome.kind == "retry":
                    raise StepFailed(outcome.error, outcome.delay_s)
                taken.append(outcome)
                if not outcome.changed or outcome.settled:
                    break
        finally:
            await self.settled(row_id, taken)
        changed = any(o.changed for o in taken)
        return Released(changed) if taken and taken[-1].released else changed
