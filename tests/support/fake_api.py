"""A canned HTTP API for client and CLI tests (an ``httpx.MockTransport``
handler): routes ``(method, path)`` to queues of answers.

:meth:`FakeApi.serve_credentials` answers the credentials endpoint the way
the server does: a kubeconfig rendered by ``core.kubeconfig`` whose context
is the requested ``context_name`` or the cluster's name (the PEM blobs are
placeholders; no certificate is parsed on the client side)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from gpuclusters.core import kubeconfig

Reply = httpx.Response | Callable[[httpx.Request], httpx.Response]


class FakeApi:
    """Routes ``(method, path)`` to a queue of answers; the last one repeats."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], list[Reply]] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, *replies: Reply) -> None:
        self.routes[(method, path)] = list(replies)

    def serve_credentials(
        self, cluster: str, *, user: str = "alice", project: str = "default"
    ) -> None:
        """Answer ``POST .../clusters/{cluster}/credentials`` like the server."""
        self.on(
            "POST",
            f"/v1/projects/{project}/clusters/{cluster}/credentials",
            lambda request: credentials_response(request, cluster=cluster, user=user),
        )

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        queue = self.routes.get((request.method, request.url.path))
        if not queue:
            return httpx.Response(404, json={"code": "not_found", "message": "no route"})
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        return reply(request) if callable(reply) else reply


def fake_kubeconfig(cluster: str, *, user: str, context_name: str | None = None) -> str:
    return kubeconfig.dump(
        kubeconfig.render(
            cluster_name=cluster,
            server=f"https://{cluster}.test:6443",
            ca_pem=f"ca of {cluster}".encode(),
            user_name=user,
            client_cert_pem=f"cert of {user}".encode(),
            client_key_pem=f"key of {user}".encode(),
            context_name=context_name,
        )
    )


def credentials_response(request: httpx.Request, *, cluster: str, user: str) -> httpx.Response:
    body = json.loads(request.content or b"{}") or {}
    context = body.get("context_name") or cluster
    return httpx.Response(
        200,
        json={
            "cluster": cluster,
            "context": context,
            "user": user,
            "kubeconfig": fake_kubeconfig(cluster, user=user, context_name=context),
        },
    )
