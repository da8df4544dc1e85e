"""Organizations, projects, users, API keys, and the first-start bootstrap."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import (
    AlreadyExistsError,
    AuthenticationError,
    NotFoundError,
    PermissionDeniedError,
    ValidationError,
)
from gpuclusters.server.db.models import ApiKey, Organization, Project, ProjectMember, User
from gpuclusters.server.security.keys import display_prefix, hash_key, new_key
from gpuclusters.server.security.principal import Principal

FIRST_UID = 10000
# Accounts Debian and our daemons already have inside nodes; an API user of
# that name would collide with them on every cluster.
RESERVED_USER_NAMES = frozenset(
    [
        "root",
        "daemon",
        "bin",
        "sys",
        "sync",
        "games",
        "man",
        "lp",
        "mail",
        "news",
        "uucp",
        "proxy",
        "www-data",
        "backup",
        "list",
        "irc",
        "gnats",
        "nobody",
        "systemd-network",
        "systemd-resolve",
        "messagebus",
        "sshd",
        "munge",
        "slurm",
        "mysql",
        "postgres",
        "_apt",
    ]
)

DEFAULT_ORG = "default"
DEFAULT_PROJECT = "default"
ADMIN_USER = "admin"


async def bootstrap(session: AsyncSession) -> str | None:
    """On the very first start, create the default organization and project
    and an admin user; return the admin's new API key (None if already done)."""
    if await session.scalar(select(Organization.id).limit(1)) is not None:
        return None
    org = Organization(name=DEFAULT_ORG)
    session.add(org)
    await session.flush()
    project = Project(organization_id=org.id, name=DEFAULT_PROJECT, description="default project")
    admin = User(organization_id=org.id, name=ADMIN_USER, is_admin=True, uid=FIRST_UID)
    session.add_all([project, admin])
    await session.flush()
    session.add(
        ProjectMember(project_id=project.id, user_id=admin.id, role=ProjectRole.ADMIN.value)
    )
    key = new_key()
    session.add(ApiKey(user_id=admin.id, key_prefix=display_prefix(key), key_hash=hash_key(key)))
    await session.commit()
    return key


async def _next_uid(session: AsyncSession, organization_id: str) -> int:
    top = await session.scalar(
        select(func.max(User.uid)).where(User.organization_id == organization_id)
    )
    return max(FIRST_UID, (top or 0) + 1)


async def authenticate(session: AsyncSession, *, key: str | None) -> Principal:
    if not key:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    row = (
        await session.execute(
            select(ApiKey, User)
            .join(User, User.id == ApiKey.user_id)
            .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
        )
    ).first()
    if row is None:
        raise AuthenticationError("invalid or revoked API key")
    _, user = row
    members = await session.execute(
        select(ProjectMember.project_id, ProjectMember.role).where(ProjectMember.user_id == user.id)
    )
    return Principal(
        user_id=user.id,
        user_name=user.name,
        organization_id=user.organization_id,
        is_admin=user.is_admin,
        roles={pid: ProjectRole(role) for pid, role in members.all()},
    )


async def resolve_project(
    session: AsyncSession, *, principal: Principal, name: str, need: ProjectRole
) -> Project:
    """The named project if the caller may act in it with role ``need``.
    Non-members get ``not_found``: other tenants' projects are invisible."""
    project = await session.scalar(
        select(Project).where(
            Project.organization_id == principal.organization_id, Project.name == name
        )
    )
    role = principal.role_in(project.id) if project is not None else None
    if project is None or role is None:
        raise NotFoundError(f"project {name!r} not found", field="project")
    if need is ProjectRole.ADMIN and role is not ProjectRole.ADMIN:
        raise PermissionDeniedError(
            f"this needs the admin role in project {name!r}; you are {role.value}"
        )
    return project


def require_org_admin(principal: Principal, what: str) -> None:
    if not principal.is_admin:
        raise PermissionDeniedError(f"{what} is for organization admins")


async def whoami(session: AsyncSession, *, principal: Principal) -> api.WhoAmI:
    org = await session.get_one(Organization, principal.organization_id)
    projects = await list_projects(session, principal=principal)
    return api.WhoAmI(
        user=principal.user_name,
        organization=org.name,
        is_admin=principal.is_admin,
        projects={p.name: p.role or ProjectRole.EDITOR for p in projects},
    )


async def list_projects(session: AsyncSession, *, principal: Principal) -> list[api.Project]:
    rows = await session.scalars(
        select(Project)
        .where(Project.organization_id == principal.organization_id)
        .order_by(Project.name)
    )
    out = []
    for p in rows:
        role = principal.role_in(p.id)
        if role is None:
            continue
        out.append(
            api.Project(name=p.name, description=p.description, role=role, created_at=p.created_at)
        )
    return out


async def create_project(
    session: AsyncSession, *, principal: Principal, body: api.ProjectCreate
) -> api.Project:
    require_org_admin(principal, "creating projects")
    project = Project(
        organization_id=principal.organization_id, name=body.name, description=body.description
    )
    session.add(project)
    try:
        await session.flush()
    except IntegrityError:
        await session.rollback()
        raise AlreadyExistsError(f"project {body.name!r} already exists", field="name") from None
    session.add(
        ProjectMember(
            project_id=project.id, user_id=principal.user_id, role=ProjectRole.ADMIN.value
        )
    )
    await session.commit()
    return api.Project(
        name=project.name,
        description=project.description,
        role=ProjectRole.ADMIN,
        created_at=project.created_at,
    )


async def create_api_key(
    session: AsyncSession, *, principal: Principal, body: api.ApiKeyCreate
) -> api.ApiKeyCreated:
    """Issue a key for ``body.user`` (created if new) and give that user
    ``body.role`` in ``body.project``. Project admins may do this for their
    own project; granting to an organization admin is refused (it would not
    narrow anything)."""
    project = await resolve_project(
        session, principal=principal, name=body.project, need=ProjectRole.ADMIN
    )
    user = await session.scalar(
        select(User).where(
            User.organization_id == principal.organization_id, User.name == body.user
        )
    )
    if user is None:
        if body.user in RESERVED_USER_NAMES:
            raise ValidationError(
                f"user: {body.user!r} is a system account on cluster nodes; choose another name",
                field="user",
            )
        user = User(
            organization_id=principal.organization_id,
            name=body.user,
            is_admin=False,
            uid=await _next_uid(session, principal.organization_id),
        )
        session.add(user)
        await session.flush()
    member = await session.get(ProjectMember, (project.id, user.id))
    if member is None:
        session.add(ProjectMember(project_id=project.id, user_id=user.id, role=body.role.value))
    else:
        member.role = body.role.value
    key = new_key()
    session.add(ApiKey(user_id=user.id, key_prefix=display_prefix(key), key_hash=hash_key(key)))
    await session.commit()
    return api.ApiKeyCreated(
        user=user.name,
        project=project.name,
        role=body.role,
        key=key,
        key_prefix=display_prefix(key),
    )
