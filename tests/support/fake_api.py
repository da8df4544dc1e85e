"""A canned HTTP API for client and CLI tests (an ``httpx.MockTransport``
handler): routes ``(method, path)`` to queues of answers."""

from __future__ import annotations

from collections.abc import Callable

import httpx

Reply = httpx.Response | Callable[[httpx.Request], httpx.Response]


class FakeApi:
    """Routes ``(method, path)`` to a queue of answers; the last one repeats."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], list[Reply]] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, *replies: Reply) -> None:
        self.routes[(method, path)] = list(replies)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        queue = self.routes.get((request.method, request.url.path))
        if not queue:
            return httpx.Response(404, json={"code": "not_found", "message": "no route"})
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        return reply(request) if callable(reply) else reply
