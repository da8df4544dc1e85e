"""Wake-up hints: the API (and reconcilers) poke a reconciler when they have
changed something it should look at, so work starts at once rather than at
the next poll. A hint is only a hint: losing one costs one poll interval."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

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
    just those (a node that moved wakes its own cluster, not all of them)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._counts: dict[str, int] = {}
        self._full: set[str] = set()
        self._rows: dict[str, set[str]] = {}

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
