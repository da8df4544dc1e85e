"""Wake-up hints: the API (and reconcilers) poke a reconciler when they have
changed something it should look at, so work starts at once rather than at
the next poll. A hint is only a hint: losing one costs one poll interval."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator

CLUSTERS = "clusters"
NODES = "nodes"
VOLUMES = "volumes"
REPAIRS = "repairs"
HEALTH = "health"
# Who may log in where changed (SSH keys, members, users): the access sync
# pushes the new authorized keys and principals to clusters' nodes.
ACCESS = "access"


class Hints:
    """Per topic: an event that wakes the topic's reconciler, and what the
    hint was about. ``notify`` asks for a full pass (every candidate);
    ``notify_rows`` names the rows that changed, so the pass can look at
    just those (a node that moved wakes its own cluster, not all of them).

    A worker that counts its passes (``worker`` and ``passing``) also lets
    a caller wait for its change to take effect: ``notify_and_settle``
    returns once a pass that began after the call has ended. That pass read
    the database after the caller's commit, so it saw the change (the
    access sync uses this: a key added is usable when the call returns)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._counts: dict[str, int] = {}
        self._full: set[str] = set()
        self._rows: dict[str, set[str]] = {}
        self._workers: set[str] = set()
        self._started: dict[str, int] = {}
        # Per topic: (pass number, future) of the callers waiting for it.
        self._settling: dict[str, list[tuple[int, asyncio.Future[bool]]]] = {}

    def _event(self, topic: str) -> asyncio.Event:
        ev = self._events.get(topic)
        if ev is None:
            ev = self._events[topic] = asyncio.Event()
        return ev

    def notify(self, *topics: str) -> None:
        for topic in topics:
            self._counts[topic] = self._counts.get(topic, 0) + 1
            self._full.add(topic)
            self._event(topic).set()

    def notify_rows(self, topic: str, row_ids: Iterable[str]) -> None:
        self._rows.setdefault(topic, set()).update(row_ids)
        self._event(topic).set()

    def take(self, topic: str) -> tuple[bool, set[str]]:
        """What was asked since the last take: a full pass, and which rows."""
        full = topic in self._full
        self._full.discard(topic)
        return full, self._rows.pop(topic, set())

    def count(self, topic: str) -> int:
        """How many full-pass hints ``topic`` has had; lets a worker tell
        whether one arrived while it was busy (and so may have been
        consumed unseen)."""
        return self._counts.get(topic, 0)

    async def wait(self, topic: str, max_wait_s: float) -> None:
        """Return when ``topic`` is notified or after ``max_wait_s``."""
        ev = self._event(topic)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a
        # cancellation that arrives as the event is set.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max_wait_s):
                await ev.wait()
        ev.clear()

    @contextlib.contextmanager
    def worker(self, topic: str) -> Iterator[None]:
        """While inside, a worker runs ``topic``'s passes; on leaving, the
        callers still waiting for a pass are answered ``False``."""
        self._workers.add(topic)
        try:
            yield
        finally:
            self._workers.discard(topic)
            for _, fut in self._settling.pop(topic, []):
                if not fut.done():
                    fut.set_result(False)

    @contextlib.contextmanager
    def passing(self, topic: str) -> Iterator[None]:
        """One pass of ``topic``'s worker: numbered when it begins; when it
        ends (failed or not), the callers waiting for it are answered."""
        number = self._started[topic] = self._started.get(topic, 0) + 1
        try:
            yield
        finally:
            waiting = self._settling.get(topic, [])
            for target, fut in waiting:
                if target <= number and not fut.done():
                    fut.set_result(True)
            self._settling[topic] = [(t, f) for t, f in waiting if not f.done()]

    async def notify_and_settle(self, topic: str, max_wait_s: float) -> bool:
        """``notify(topic)``, then wait until a pass that begins after now
        has ended. ``False`` at once when no worker runs the topic, or
        after ``max_wait_s`` (the change still takes effect, later)."""
        self.notify(topic)
        if topic not in self._workers:
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._settling.setdefault(topic, []).append((self._started.get(topic, 0) + 1, fut))
        try:
            async with asyncio.timeout(max_wait_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
