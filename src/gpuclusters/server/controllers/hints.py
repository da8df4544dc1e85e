"""Wake-up hints: the API (and reconcilers) poke a reconciler when they have
changed something it should look at, so work starts at once rather than at
the next poll. A hint is only a hint: losing one costs one poll interval."""

from __future__ import annotations

import asyncio
import contextlib

CLUSTERS = "clusters"
NODES = "nodes"
VOLUMES = "volumes"


class Hints:
    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, topic: str) -> asyncio.Event:
        ev = self._events.get(topic)
        if ev is None:
            ev = self._events[topic] = asyncio.Event()
        return ev

    def notify(self, *topics: str) -> None:
        for topic in topics:
            self._event(topic).set()

    async def wait(self, topic: str, max_wait_s: float) -> None:
        """Return when ``topic`` is notified or after ``max_wait_s``."""
        ev = self._event(topic)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), max_wait_s)
        ev.clear()
