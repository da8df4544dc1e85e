"""Who may pull and push which repositories of the image registry (pure).

The registry (CNCF Distribution, docs/kubernetes.md "Images") hands every
authorization decision to the API server through the Docker token protocol:
a client asks ``GET /v1/registry/token?service=...&scope=repository:NAME:pull,push``
with its credentials, and the token it gets back lists the actions granted.
This module decides that list; it does no I/O.

Repository names:

* ``<project>/<anything>``: a project's images. Members of the project
  (admins and editors) and organization admins pull and push; a cluster's
  nodes (the cluster's pull credential) pull the images of the cluster's
  project only. Nobody else gets anything: another project can neither
  pull nor push.
* a single path component (``gpuclusters-base``, ``kueue``, ``torch``, ...):
  the project's own system images. Every authenticated caller pulls them;
  only the server itself pushes (it mints its own tokens, never through
  this module). Project names cannot be used to push there, since a
  project's repositories always have a ``/``.

Scopes follow the Docker registry token specification:
``repository:<name>:<action>[,<action>...]``; other resource types
(``registry:catalog:*``) are never granted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PULL = "pull"
PUSH = "push"
# Repository names as the distribution specification defines them.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_KNOWN_ACTIONS = {PULL, PUSH, "delete", "*"}


@dataclass(frozen=True, slots=True)
class Scope:
    resource_type: str
    name: str
    actions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Grant:
    """A granted scope, as the token's ``access`` claim lists it."""

    name: str
    actions: tuple[str, ...]
    resource_type: str = "repository"

    def claim(self) -> dict[str, object]:
        return {"type": self.resource_type, "name": self.name, "actions": list(self.actions)}


@dataclass(frozen=True, slots=True)
class RegistryCaller:
    """Who asks, reduced to what matters for the registry.

    ``push_projects`` and ``pull_projects`` are names of existing projects
    (an organization admin's are all of the organization's)."""

    subject: str
    pull_projects: frozenset[str] = field(default_factory=frozenset)
    push_projects: frozenset[str] = field(default_factory=frozenset)


def parse_scopes(raw: list[str]) -> list[Scope]:
    """``scope`` query values (each may hold several space-separated scopes).
    Malformed ones are skipped: the token then simply grants less, which is
    what the specification asks of a token server."""
    scopes: list[Scope] = []
    for value in raw:
        for item in value.split():
            parts = item.split(":")
            if len(parts) < 3:
                continue
            # A name may hold a port-less host part with ':' only in odd clients;
            # the resource type is the first field, the actions the last.
            resource_type, name, actions = parts[0], ":".join(parts[1:-1]), parts[-1]
            if not name:
                continue
            acts = tuple(a for a in actions.split(",") if a in _KNOWN_ACTIONS)
            scopes.append(Scope(resource_type, name, acts))
    return scopes


def is_repository_name(name: str) -> bool:
    return len(name) <= 255 and bool(_REPOSITORY_RE.match(name))


def project_of(repository: str) -> str | None:
    """The project a repository belongs to; ``None`` for system images."""
    head, sep, _ = repository.partition("/")
    return head if sep else None


def allowed_actions(caller: RegistryCaller, repository: str) -> set[str]:
    if not is_repository_name(repository):
        return set()
    project = project_of(repository)
    if project is None:
        return {PULL}
    if project in caller.push_projects:
        return {PULL, PUSH}
    if project in caller.pull_projects:
        return {PULL}
    return set()


def grants(caller: RegistryCaller, scopes: list[Scope]) -> list[Grant]:
    """What to grant for the requested scopes: the intersection of what was
    asked and what the caller may do, per repository (``*`` asks for all)."""
    out: list[Grant] = []
    for scope in scopes:
        if scope.resource_type != "repository":
            continue
        allowed = allowed_actions(caller, scope.name)
        wanted = allowed if "*" in scope.actions else set(scope.actions)
        given = tuple(sorted(allowed & wanted))
        if given:
            out.append(Grant(scope.name, given))
    return out
