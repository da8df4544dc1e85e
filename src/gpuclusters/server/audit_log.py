"""The audit log's writer: a plain ASGI middleware around the whole app, so
every mutating request is recorded whatever route serves it (API or
console), and none can be forgotten (``services/audit.py`` reads them).

What a record holds:

* **who**: the principal the request authenticated as. The API's and the
  console's authentication dependencies leave it in the request's state
  (``PRINCIPAL_STATE``); a request that never authenticated (a bad key, a
  failed sign-in) is recorded with no user.
* **from where**: the peer address of the connection.
* **what**: the route's name (``create_cluster``), method and template.
* **on which object**: the path below the project (``clusters/demo``); a
  create adds the new object's ``name`` (or ``user``) from the body, so
  ``POST .../clusters {"name": "demo"}`` is ``clusters/demo``; the project
  is the path's, else the ``project`` a body names (an API key's). Nothing
  else of a body is kept: bodies carry keys and secrets.
* **the outcome**: the status, and the error's code and message. The
  console answers a form it refused with a redirect back to the page with
  ``?error=<message>``: that is recorded as refused, with the message.

Not recorded: reads (GET, but for the provider sending a browser back to
sign in), machine traffic that is not anyone's action
(node and host agents' heartbeats, the rule engine's alerts), and a device
sign-in's polls while it is pending (its outcome is recorded).

The record is written after the answer has gone out, so it costs the caller
no latency; a server killed in between loses that one record (the action
itself is in the database, and the controllers' events record what follows).
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import audit

log = logging.getLogger(__name__)

PRINCIPAL_STATE = "audit_principal"
AUDITED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# GETs that act: the identity provider sends the browser back to sign it in.
AUDITED_GETS = frozenset({"/login/sso/callback"})
# Machines, not people: heartbeats, and the alerts vmalert posts.
NOT_AUDITED_ROUTES = frozenset({"/v1/hosts/{name}/heartbeat", "/v1/metrics/alerts/api/v2/alerts"})
NOT_AUDITED_PREFIXES = ("/agent/",)
# A device sign-in's polls while the user has not finished (202): only its
# outcome is anyone's action.
NOT_AUDITED_WHILE_PENDING = frozenset({"/v1/auth/sso/device/token"})
BODY_LIMIT = 64 * 1024  # enough for any create's body; more is not read for the name
ERROR_LIMIT = 4096
NAME_FIELDS = ("name", "user")
# Console form routes that create into a collection of another name.
COLLECTION_OF_FORM = {"new-cluster": "clusters"}


def remember_principal(state: Any, principal: Principal) -> None:
    """Called by the authentication dependencies: who this request is."""
    setattr(state, PRINCIPAL_STATE, principal)


def _body_fields(body: bytes, content_type: str) -> dict[str, str]:
    """The string fields of a JSON or form body ({} for anything else)."""
    if not body:
        return {}
    try:
        if content_type.startswith("application/json"):
            data = json.loads(body)
            fields = data if isinstance(data, dict) else {}
        elif content_type.startswith("application/x-www-form-urlencoded"):
            fields = {k: v[0] for k, v in parse_qs(body.decode()).items() if v}
        else:
            return {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return {k: v for k, v in fields.items() if isinstance(k, str) and isinstance(v, str)}


def _created_name(fields: dict[str, str]) -> str:
    """The new object's name in a create's body, or ""."""
    for key in NAME_FIELDS:
        if fields.get(key):
            return fields[key][:64]
    return ""


def object_of(template: str, path: str, project: str, created: str) -> str:
    """The object below the organization or project: ``clusters/demo``."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["v1"]:
        parts = parts[1:]
    if project and parts[:2] == ["projects", project]:
        parts = parts[2:]
    # A create: the route ends at a collection, and the body names the object.
    if created and not template.rstrip("/").endswith("}"):
        if parts:
            parts[-1] = COLLECTION_OF_FORM.get(parts[-1], parts[-1])
        parts.append(created)
    return "/".join(parts)


def _sent_back(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The console's refusal in a redirect's ``?error=``, if any."""
    for key, value in headers:
        if key.lower() == b"location":
            query = urlsplit(value.decode("latin-1")).query
            errors = parse_qs(query).get("error")
            return errors[0] if errors else None
    return None


def _detail(status: int, body: bytes) -> str:
    if status < 400 or not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if isinstance(data, dict) and "message" in data:
        return f"{data.get('code', '')}: {data['message']}"
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:1000]
    return ""


class AuditMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if (
            scope["type"] != "http"
            or (scope["method"] not in AUDITED_METHODS and path not in AUDITED_GETS)
            or path.startswith(NOT_AUDITED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        # The dict the routes' ``request.state`` writes to (same scope).
        state: dict[str, Any] = scope.setdefault("state", {})
        body = bytearray()
        answer = bytearray()
        status = 500  # what the client gets if the app fails before answering
        refusal: str | None = None

        async def tee_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(body) < BODY_LIMIT:
                body.extend(message.get("body", b"")[: BODY_LIMIT - len(body)])
            return message

        async def tee_send(message: Message) -> None:
            nonlocal status, refusal
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if status == 303 and not path.startswith("/v1/"):
                    refusal = _sent_back(message.get("headers", []))
            elif message["type"] == "http.response.body" and status >= 400:
                answer.extend(message.get("body", b"")[: max(0, ERROR_LIMIT - len(answer))])
            await send(message)

        try:
            await self.app(scope, tee_receive, tee_send)
        finally:
            await self._record(scope, state, bytes(body), status, bytes(answer), refusal)

    async def _record(
        self,
        scope: Scope,
        state: dict[str, Any],
        body: bytes,
        status: int,
        answer: bytes,
        refusal: str | None,
    ) -> None:
        route = scope.get("route")
        template = getattr(route, "path", None)
        if template is None or template in NOT_AUDITED_ROUTES:
            return  # no such route: nothing was acted on
        if status == 202 and template in NOT_AUDITED_WHILE_PENDING:
            return
        principal = state.get(PRINCIPAL_STATE)
        params = scope.get("path_params") or {}
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        fields = _body_fields(body, headers.get("content-type", ""))
        created = _created_name(fields)
        # The project in the path, else the one a body names (an API key's).
        project = str(params.get("project", "")) or fields.get("project", "")[:64]
        client = scope.get("client")
        entry = audit.Entry(
            principal=principal if isinstance(principal, Principal) else None,
            via="api" if template.startswith("/v1/") else "console",
            address=str(client[0]) if client else "",
            method=str(scope["method"]),
            action=str(getattr(route, "name", "") or ""),
            route=template,
            project_name=project,
            object=object_of(template, str(scope.get("path", "")), project, created),
            status=status,
            outcome="refused" if refusal is not None else audit.outcome_of(status),
            detail=refusal if refusal is not None else _detail(status, answer),
        )
        rt: Runtime | None = getattr(scope["app"].state, "runtime", None)
        if rt is None:
            return
        try:
            async with rt.request_sessionmaker() as session:
                await audit.record(session, entry)
                await session.commit()
        except Exception:
            log.exception("audit: could not record %s %s", entry.method, entry.route)
