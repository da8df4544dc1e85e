"""Wake-up hints: the API (and reconcilers) poke a reconciler when they have
changed something it should look at, so work starts at once rather than at
the next poll. A hint is only a hint: losing one costs one poll interval."""

from __future__ import annotations

import asyncio
import contextlib

CLUSTERS = "clusters"
NODES = "nodes"
VOLUMES = "volumes"
REPAIRS = "repairs"
HEALTH = "health"
# Who may log in where changed (SSH keys, members, users): the access sync
# pushes the new authorized keys and principals to clusters' nodes.
ACCESS = "access"


class Hints:
    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._counts: dict[str, int] = {}

    def _event(self, topic: str) -> asyncio.Event:
        ev = self._events.get(topic)
        if ev is None:
            ev = self._events[topic] = asyncio.Event()
        return ev

    def notify(self, *topics: str) -> None:
        for topic in topics:
            self._counts[topic] = self._counts.get(topic, 0) + 1
            self._event(topic).set()

    def count(self, topic: str) -> int:
        """How many hints ``topic`` has had; lets a worker tell whether one
        arrived while it was busy (and so may have been consumed unseen)."""
        return self._counts.get(topic, 0)

    async def wait(self, topic: str, max_wait_s: float) -> None:
        """Return when ``topic`` is notified or after ``max_wait_s``."""
        ev = self._event(topic)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), max_wait_s)
        ev.clear()
