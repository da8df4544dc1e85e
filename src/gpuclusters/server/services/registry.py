"""Tokens for the image registry: who is asking, and what they get.

The registry sends clients without a token to ``GET /v1/registry/token``
(its ``realm``) with HTTP Basic credentials:

* a user: their user name and an API key as the password (``skopeo login``,
  ``podman login``, ``docker login``);
* a cluster's nodes: the cluster's pull credential (``cluster-<id>``), which
  containerd on every node of the cluster holds.

What either may do is decided by :mod:`gpuclusters.core.registry_access`.
A request without credentials gets a token with no grants (anonymous
clients probe ``/v2/`` first), never an error, as the token specification
expects; wrong credentials are an authentication error.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from prometheus_client import Counter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.errors import AuthenticationError
from gpuclusters.core.registry_access import RegistryCaller, grants, parse_scopes
from gpuclusters.server.db.models import Cluster, Project
from gpuclusters.server.security.registry_tokens import SERVICE, TOKEN_TTL_S, RegistryKeys
from gpuclusters.server.services import tenancy


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str
    issued_at: int
    expires_in: int


def basic_credentials(header: str) -> tuple[str, str] | None:
    """``(user, password)`` from an ``Authorization: Basic`` header."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise AuthenticationError("malformed Basic credentials") from None
    user, sep, password = decoded.partition(":")
    if not sep:
        raise AuthenticationError("malformed Basic credentials: expected USER:PASSWORD")
    return user, password


async def caller_for(
    session: AsyncSession, keys: RegistryKeys, credentials: tuple[str, str] | None
) -> RegistryCaller:
    if credentials is None:
        return RegistryCaller(subject="anonymous")
    user, password = credentials
    cluster_id = keys.cluster_of(user, password)
    if cluster_id is not None:
        project = await session.scalar(
            select(Project.name)
            .join(Cluster, Cluster.project_id == Project.id)
            .where(Cluster.id == cluster_id, Cluster.deleted_at.is_(None))
        )
        if project is None:
            raise AuthenticationError("this cluster's pull credential is no longer valid")
        return RegistryCaller(subject=user, pull_projects=frozenset({project}))
    principal = await tenancy.authenticate(session, key=password)
    if user != principal.user_name:
        raise AuthenticationError(
            f"user name {user!r} does not match the API key (it belongs to "
            f"{principal.user_name!r}): log in as that user with the key as the password"
        )
    query = select(Project.id, Project.name).where(
        Project.organization_id == principal.organization_id
    )
    if not principal.is_admin:  # organization admins act in every project
        query = query.where(Project.id.in_(list(principal.roles)))
    # Admins and editors both use what a project has (contract section 9).
    member_of = frozenset(name for _, name in (await session.execute(query)).all())
    return RegistryCaller(
        subject=principal.user_name, pull_projects=member_of, push_projects=member_of
    )


REGISTRY_TOKENS = Counter(
    "gpuclusters_registry_tokens_total",
    "Registry tokens issued, by the most they allow (push, pull or none)",
    ["access"],
)


async def issue_token(
    session: AsyncSession,
    keys: RegistryKeys,
    *,
    authorization: str,
    service: str | None,
    scopes: list[str],
) -> IssuedToken:
    if service not in (None, "", SERVICE):
        raise AuthenticationError(f"this server issues tokens for {SERVICE!r} only")
    caller = await caller_for(session, keys, basic_credentials(authorization))
    given = grants(caller, parse_scopes(scopes))
    token, now = keys.mint(subject=caller.subject, access=[g.claim() for g in given])
    granted = {action for g in given for action in g.actions}
    # A push token is what a push starts with: pushes and pulls per kind.
    REGISTRY_TOKENS.labels("push" if "push" in granted else "pull" if granted else "none").inc()
    return IssuedToken(token=token, issued_at=now, expires_in=TOKEN_TTL_S)
