"""Organizations, projects, users, API keys, and the first-start bootstrap.

Deleting a user keeps their row with ``deleted_at`` set: their API keys are
revoked, their memberships removed and their SSH keys soft-deleted, and
neither their name nor their uid is ever handed out again (the uid owns
files on shared volumes; the name is a Unix account that stays on nodes).
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import idblocks
from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import (
    AlreadyExistsError,
    AuthenticationError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    ValidationError,
)
from gpuclusters.server.db.models import (
    ApiKey,
    Organization,
    Project,
    ProjectMember,
    SshKey,
    User,
    utcnow,
)
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
    project = Project(
        organization_id=org.id,
        name=DEFAULT_PROJECT,
        description="default project",
        id_block=await _next_id_block(session),
    )
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


async def next_uid(session: AsyncSession, organization_id: str) -> int:
    # Deleted users keep their rows, so their uids count here: never reused.
    top = await session.scalar(
        select(func.max(User.uid)).where(User.organization_id == organization_id)
    )
    uid = max(FIRST_UID, (top or 0) + 1)
    if uid > idblocks.LAST_USER_ID:
        raise InvalidStateError(
            f"the organization has used every user id ({FIRST_UID}-{idblocks.LAST_USER_ID})"
        )
    return uid


async def _next_id_block(session: AsyncSession) -> int:
    # Across organizations: a block is a range of host ids, one per project.
    return idblocks.next_index([await session.scalar(select(func.max(Project.id_block)))])


async def authenticate(session: AsyncSession, *, key: str | None) -> Principal:
    if not key:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    principal, _ = await principal_for_key(session, ApiKey.key_hash == hash_key(key))
    return principal


async def principal_for_key(
    session: AsyncSession, which: ColumnElement[bool]
) -> tuple[Principal, ApiKey]:
    """The caller behind the live API key ``which`` selects (by hash, or by
    id for a console session), and that key."""
    # The key, its user and the user's roles in one query (every request
    # makes it): a row per membership, or one with no project.
    rows = (
        await session.execute(
            select(ApiKey, User, ProjectMember.project_id, ProjectMember.role)
            .join(User, User.id == ApiKey.user_id)
            .outerjoin(ProjectMember, ProjectMember.user_id == User.id)
            .where(
                which,
                ApiKey.revoked_at.is_(None),
                # A single sign-on session's key ends with the session.
                or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()),
                # Deleting a user revokes their keys too; this holds even if not.
                User.deleted_at.is_(None),
            )
        )
    ).all()
    if not rows:
        raise AuthenticationError("invalid or revoked API key")
    key_row, user = rows[0][0], rows[0][1]
    principal = Principal(
        user_id=user.id,
        user_name=user.name,
        organization_id=user.organization_id,
        is_admin=user.is_admin,
        roles={pid: ProjectRole(role) for _, _, pid, role in rows if pid is not None},
    )
    return principal, key_row


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


def _host_ids(project: Project, id_start: int) -> api.IdRange:
    block = idblocks.block(project.id_block, id_start)
    return api.IdRange(first=block.first, last=block.last)


async def list_projects(
    session: AsyncSession, *, principal: Principal, id_start: int = idblocks.DEFAULT_START
) -> list[api.Project]:
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
            api.Project(
                name=p.name,
                description=p.description,
                role=role,
                created_at=p.created_at,
                host_ids=_host_ids(p, id_start),
            )
        )
    return out


async def create_project(
    session: AsyncSession,
    *,
    principal: Principal,
    body: api.ProjectCreate,
    id_start: int = idblocks.DEFAULT_START,
) -> api.Project:
    require_org_admin(principal, "creating projects")
    project = await _insert_project(session, principal.organization_id, body)
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
        host_ids=_host_ids(project, id_start),
    )


async def _insert_project(
    session: AsyncSession, organization_id: str, body: api.ProjectCreate
) -> Project:
    """Insert the project with the next id block. Two replicas may pick the
    same block at once; the unique constraint refuses the second, which
    picks again."""
    for _ in range(5):
        project = Project(
            organization_id=organization_id,
            name=body.name,
            description=body.description,
            id_block=await _next_id_block(session),
        )
        session.add(project)
        try:
            await session.flush()
            return project
        except IntegrityError:
            await session.rollback()
        taken = await session.scalar(
            select(Project.id).where(
                Project.organization_id == organization_id, Project.name == body.name
            )
        )
        if taken is not None:
            raise AlreadyExistsError(f"project {body.name!r} already exists", field="name")
    raise InvalidStateError("could not reserve an id block for the project; try again")


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
    if user is not None and user.deleted_at is not None:
        raise InvalidStateError(
            f"user {body.user!r} was deleted; a deleted user's name (and uid) is never "
            "reused, so its files and Unix account cannot pass to someone else: choose "
            "another name",
            field="user",
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
            uid=await next_uid(session, principal.organization_id),
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


# --- members and users ---------------------------------------------------------


async def list_members(
    session: AsyncSession, *, principal: Principal, project: str
) -> list[api.ProjectMember]:
    """The project's members (any member may look)."""
    p = await resolve_project(session, principal=principal, name=project, need=ProjectRole.EDITOR)
    rows = await session.execute(
        select(User.name, ProjectMember.role, User.uid)
        .join(User, User.id == ProjectMember.user_id)
        .where(ProjectMember.project_id == p.id, User.deleted_at.is_(None))
        .order_by(User.name)
    )
    return [
        api.ProjectMember(user=name, role=ProjectRole(role), uid=uid) for name, role, uid in rows
    ]


async def remove_member(
    session: AsyncSession, *, principal: Principal, project: str, user: str
) -> api.ProjectMember:
    """Remove ``user`` from the project (project admins and org admins); the
    project's last admin member stays. Returns the removed membership."""
    p = await resolve_project(session, principal=principal, name=project, need=ProjectRole.ADMIN)
    # Lock the project row so two concurrent removals cannot both pass the
    # last-admin check (PostgreSQL; SQLite serializes writers anyway).
    await session.execute(select(Project.id).where(Project.id == p.id).with_for_update())
    row = (
        await session.execute(
            select(ProjectMember, User)
            .join(User, User.id == ProjectMember.user_id)
            .where(
                ProjectMember.project_id == p.id,
                User.organization_id == principal.organization_id,
                User.name == user,
                User.deleted_at.is_(None),
            )
        )
    ).first()
    if row is None:
        raise NotFoundError(f"user {user!r} is not a member of project {project!r}", field="user")
    member, target = row
    role = ProjectRole(member.role)
    if role is ProjectRole.ADMIN:
        admins = await session.scalar(
            select(func.count())
            .select_from(ProjectMember)
            .join(User, User.id == ProjectMember.user_id)
            .where(
                ProjectMember.project_id == p.id,
                ProjectMember.role == ProjectRole.ADMIN.value,
                User.deleted_at.is_(None),
            )
        )
        if (admins or 0) <= 1:
            raise InvalidStateError(
                f"{user!r} is the last admin of project {project!r}; give another member "
                "the admin role first (api-keys create --role admin)",
                field="user",
            )
    await session.delete(member)
    await session.commit()
    return api.ProjectMember(user=target.name, role=role, uid=target.uid)


async def _memberships(
    session: AsyncSession, organization_id: str
) -> dict[str, dict[str, ProjectRole]]:
    """user id -> {project name: role} for every membership in the organization."""
    rows = await session.execute(
        select(ProjectMember.user_id, Project.name, ProjectMember.role)
        .join(Project, Project.id == ProjectMember.project_id)
        .where(Project.organization_id == organization_id)
        .order_by(Project.name)
    )
    out: dict[str, dict[str, ProjectRole]] = {}
    for user_id, project, role in rows:
        out.setdefault(user_id, {})[project] = ProjectRole(role)
    return out


def _user_view(user: User, projects: dict[str, ProjectRole]) -> api.User:
    return api.User(
        name=user.name,
        uid=user.uid,
        is_admin=user.is_admin,
        created_at=user.created_at,
        projects=projects,
        deleted_at=user.deleted_at,
    )


async def list_users(
    session: AsyncSession, *, principal: Principal, include_deleted: bool = False
) -> list[api.User]:
    require_org_admin(principal, "listing users")
    query = select(User).where(User.organization_id == principal.organization_id)
    if not include_deleted:
        query = query.where(User.deleted_at.is_(None))
    users = (await session.scalars(query.order_by(User.name))).all()
    memberships = await _memberships(session, principal.organization_id)
    return [_user_view(u, memberships.get(u.id, {})) for u in users]


async def delete_user(session: AsyncSession, *, principal: Principal, name: str) -> api.User:
    """Delete a user (org admins): revoke their API keys, remove their
    memberships, soft-delete their SSH keys, and mark them deleted. Refuses
    the caller themselves and the organization's last admin."""
    require_org_admin(principal, "deleting users")
    # One user deletion at a time per organization (PostgreSQL row lock), so
    # two admins deleting each other cannot leave none.
    await session.execute(
        select(Organization.id)
        .where(Organization.id == principal.organization_id)
        .with_for_update()
    )
    user = await session.scalar(
        select(User).where(
            User.organization_id == principal.organization_id,
            User.name == name,
            User.deleted_at.is_(None),
        )
    )
    if user is None:
        raise NotFoundError(f"user {name!r} not found", field="name")
    if user.id == principal.user_id:
        raise InvalidStateError(
            "you cannot delete yourself; ask another organization admin", field="name"
        )
    if user.is_admin:
        admins = await session.scalar(
            select(func.count())
            .select_from(User)
            .where(
                User.organization_id == principal.organization_id,
                User.is_admin.is_(True),
                User.deleted_at.is_(None),
            )
        )
        if (admins or 0) <= 1:
            raise InvalidStateError(f"{name!r} is the organization's last admin", field="name")
    now = utcnow()
    await session.execute(
        update(ApiKey)
        .where(ApiKey.user_id == user.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    await session.execute(delete(ProjectMember).where(ProjectMember.user_id == user.id))
    await session.execute(
        update(SshKey)
        .where(SshKey.user_id == user.id, SshKey.deleted_at.is_(None))
        .values(deleted_at=now)
    )
    user.deleted_at = now
    await session.commit()
    return _user_view(user, {})
