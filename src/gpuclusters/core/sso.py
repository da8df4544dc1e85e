"""Single sign-on's pure rules (docs/identity.md): the roles an identity
provider's groups give, and the user name its claims make.

**Roles from groups.** The operator maps groups to roles
(``GPUCLUSTERS_SSO_GROUP_ROLES``): a group may make its members
organization admins, or give them a role in one project. A user in several
groups gets the strongest role each project is given (admin over editor).
The mapping is applied at every sign-in and every recheck of a session, and
it is the whole truth for a signed-in user: a role no group gives any more
is taken away.

**User names.** A user's name is their Unix account on every node and a
DNS label in Kubernetes, so the claim it comes from (``preferred_username``
by default, then the local part of ``email``) is lowered and reduced to
``[a-z0-9-]``, starting with a letter, at most 40 characters. Two people
whose claims reduce to the same name are told apart by their subject (the
identity provider's stable id), which is what a user is linked by: the
second gets the name with a number (``ana-2``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuclusters.core.enums import ProjectRole

_RANK = {ProjectRole.EDITOR: 1, ProjectRole.ADMIN: 2}
_NOT_NAME = re.compile(r"[^a-z0-9-]+")
MAX_NAME = 40


@dataclass(frozen=True, slots=True)
class GroupGrant:
    """Members of ``group`` become organization admins, or get ``role`` in
    ``project``."""

    group: str
    project: str | None = None
    role: ProjectRole | None = None
    org_admin: bool = False

    def __post_init__(self) -> None:
        if self.org_admin == (self.project is not None):
            raise ValueError(
                f"group {self.group!r}: give either org_admin: true or a project and a role"
            )
        if self.project is not None and self.role is None:
            raise ValueError(f"group {self.group!r}: a project needs a role (admin or editor)")


@dataclass(frozen=True, slots=True)
class Grants:
    org_admin: bool = False
    projects: dict[str, ProjectRole] = field(default_factory=dict)


def grants_for(groups: Iterable[str], mapping: Iterable[GroupGrant]) -> Grants:
    """What ``groups`` give under ``mapping``."""
    mine = set(groups)
    admin = False
    projects: dict[str, ProjectRole] = {}
    for grant in mapping:
        if grant.group not in mine:
            continue
        if grant.org_admin:
            admin = True
            continue
        assert grant.project is not None and grant.role is not None
        held = projects.get(grant.project)
        if held is None or _RANK[grant.role] > _RANK[held]:
            projects[grant.project] = grant.role
    return Grants(org_admin=admin, projects=projects)


def groups_of(claims: Mapping[str, object], claim: str) -> list[str]:
    """The groups claim as a list of strings (a single string is one group)."""
    value = claims.get(claim)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [g for g in value if isinstance(g, str)]
    return []


def name_from_claims(claims: Mapping[str, object], claim: str) -> str:
    """The user name ``claims`` make (see the module's docstring); "" when
    none of the claims gives a usable name."""
    candidates = [claims.get(claim), claims.get("preferred_username")]
    email = claims.get("email")
    if isinstance(email, str) and "@" in email:
        candidates.append(email.split("@", 1)[0])
    for value in candidates:
        if not isinstance(value, str):
            continue
        name = _NOT_NAME.sub("-", value.lower()).strip("-")
        name = re.sub(r"^[^a-z]+", "", name)[:MAX_NAME].rstrip("-")
        if name:
            return name
    return ""


def numbered(name: str, n: int) -> str:
    """``name`` told apart by ``n`` (2, 3, ...), still at most 40 characters."""
    suffix = f"-{n}"
    return name[: MAX_NAME - len(suffix)].rstrip("-") + suffix
