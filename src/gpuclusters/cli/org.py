"""Organization-level commands: projects, api-keys, users, hosts, gpu-types, regions, whoami.

None of these is project-scoped, so none takes ``--project`` (``api-keys
create`` names its project explicitly), except ``projects members ...``,
which acts in the configured project unless ``--project`` names one.
``api-keys create`` prints the new secret on stdout, which is the only time
the server ever reveals it, and says so on stderr. ``users delete`` and
``projects members remove`` ask no confirmation (they are for scripts too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from gpuclusters.cli.context import (
    CursorOpt,
    LimitOpt,
    OutputFormat,
    OutputOpt,
    ProjectOpt,
    ReasonOpt,
    api_command,
    forced_reason,
    note_next_page,
    one_or_every_page,
    open_client,
    stderr_console,
)
from gpuclusters.cli.render import age, clock, details, emit, optional, table
from gpuclusters.core.enums import HostState, ProjectRole
from gpuclusters.core.models import (
    ApiKeyCreated,
    GpuType,
    Host,
    Project,
    ProjectBudget,
    ProjectMember,
    ProjectQuota,
    Region,
    User,
    WhoAmI,
)
from gpuclusters.core.quotas import WHAT

projects_app = typer.Typer(help="Projects you belong to.", no_args_is_help=True)
api_keys_app = typer.Typer(help="Issue API keys.", no_args_is_help=True)
hosts_app = typer.Typer(help="The fleet of hosts (org admins).", no_args_is_help=True)
gpu_types_app = typer.Typer(help="GPU types on offer.", no_args_is_help=True)
regions_app = typer.Typer(help="Regions.", no_args_is_help=True)
members_app = typer.Typer(help="Members of a project.", no_args_is_help=True)
quota_app = typer.Typer(
    help="A project's quotas: what it may hold at once (organization admins set them).",
    no_args_is_help=True,
)
users_app = typer.Typer(help="The organization's users (org admins).", no_args_is_help=True)
projects_app.add_typer(members_app, name="members")
projects_app.add_typer(quota_app, name="quota")


def projects_table(projects: Sequence[Project]) -> RenderableType:
    t = table("NAME", "ROLE", "DESCRIPTION", "AGE")
    for p in projects:
        t.add_row(p.name, optional(p.role), p.description, age(p.created_at))
    return t


def members_table(members: Sequence[ProjectMember]) -> RenderableType:
    t = table("USER", "ROLE", "UID")
    for m in members:
        t.add_row(m.user, m.role.value, optional(m.uid))
    return t


def users_table(users: Sequence[User]) -> RenderableType:
    deleted = any(u.deleted_at is not None for u in users)
    columns = ["NAME", "UID", "ORG_ADMIN", "PROJECTS", "AGE"] + (["DELETED"] if deleted else [])
    t = table(*columns)
    for u in users:
        projects = ", ".join(f"{name} ({role.value})" for name, role in sorted(u.projects.items()))
        row = [
            u.name,
            optional(u.uid),
            "yes" if u.is_admin else "no",
            projects or "-",
            age(u.created_at),
        ]
        if deleted:
            row.append(clock(u.deleted_at) if u.deleted_at else "-")
        t.add_row(*row)
    return t


def hosts_table(hosts: Sequence[Host]) -> RenderableType:
    t = table(
        "NAME",
        "REGION",
        "GPU_TYPE",
        "GPUS",
        "NVME_GIB",
        "IB_ISLAND",
        "STATE",
        "AGENT",
        "CLUSTER",
        "NODE",
        "CLASS",
    )
    for h in hosts:
        agent = h.agent_status.value if h.agent_status else "-"
        agent_style = "green" if agent == "ready" else "red" if agent == "unreachable" else ""
        t.add_row(
            h.name,
            h.region,
            h.gpu_type,
            str(h.num_gpus),
            str(h.nvme_gib),
            h.ib_island,
            Text(h.state.value, style="yellow" if h.state is HostState.CORDONED else ""),
            Text(agent, style=agent_style),
            optional(h.cluster),
            optional(h.node),
            optional(h.compute_class.value if h.compute_class else None),
        )
    return t


def gpu_types_table(types: Sequence[GpuType]) -> RenderableType:
    t = table("NAME", "MEMORY_GIB", "GPUS_PER_NODE", "FREE_HOSTS", "TOTAL_HOSTS")
    for g in types:
        t.add_row(
            g.name, str(g.memory_gib), str(g.gpus_per_node), str(g.free_hosts), str(g.total_hosts)
        )
    return t


def regions_table(regions: Sequence[Region]) -> RenderableType:
    t = table("NAME", "GPU_TYPES", "HOSTS")
    for r in regions:
        t.add_row(r.name, ", ".join(r.gpu_types), str(r.total_hosts))
    return t


def whoami_view(me: WhoAmI, *, url: str) -> RenderableType:
    projects = ", ".join(f"{name} ({role.value})" for name, role in sorted(me.projects.items()))
    return details(
        [
            ("user", me.user),
            ("organization", me.organization),
            ("org admin", "yes" if me.is_admin else "no"),
            ("projects", projects or "-"),
            ("server", url),
        ]
    )


def api_key_view(created: ApiKeyCreated) -> RenderableType:
    return details(
        [
            ("user", created.user),
            ("project", created.project),
            ("role", created.role.value),
            ("key", Text(created.key, style="bold")),
        ]
    )


@projects_app.command("list")
@api_command
def projects_list(output: OutputOpt = OutputFormat.TABLE) -> None:
    """List the projects you are a member of."""
    with open_client() as client:
        projects = client.projects.list()
    emit(output, projects, render=lambda: projects_table(projects), empty="no projects")


@projects_app.command("create")
@api_command
def projects_create(
    name: Annotated[str, typer.Argument(help="project name: a DNS label")],
    *,
    description: Annotated[str, typer.Option("--description", "-d")] = "",
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Create a project (org admins); you become its admin."""
    with open_client() as client:
        project = client.projects.create({"name": name, "description": description})
    emit(output, project, render=lambda: projects_table([project]))


def quota_view(q: ProjectQuota) -> RenderableType:
    t = table("QUOTA", "LIMIT", "USE")
    for name in WHAT:
        limit = getattr(q.limits, name)
        t.add_row(name, "none" if limit is None else str(limit), str(getattr(q.use, name)))
    return t


def _limit(value: str | None, name: str) -> int | None:
    if value is None or value == "none":
        return None
    try:
        number = int(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a whole number (or none)", param_hint=f"--{name}"
        ) from None
    if number < 0:
        raise typer.BadParameter("must be 0 or more (or none)", param_hint=f"--{name}")
    return number


@quota_app.command("get")
@api_command
def quota_get(*, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE) -> None:
    """The project's quotas and what it holds now."""
    with open_client(project) as client:
        q = client.projects.quota()
    emit(output, q, render=lambda: quota_view(q))


@quota_app.command("set")
@api_command
def quota_set(
    *,
    standard_gpus: Annotated[
        str | None, typer.Option("--standard-gpus", help="a number, or none", show_default=False)
    ] = None,
    preemptible_gpus: Annotated[
        str | None,
        typer.Option("--preemptible-gpus", help="a number, or none", show_default=False),
    ] = None,
    clusters: Annotated[
        str | None, typer.Option("--clusters", help="a number, or none", show_default=False)
    ] = None,
    volume_tib: Annotated[
        str | None,
        typer.Option("--volume-tib", help="TiB of volumes, or none", show_default=False),
    ] = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Set the project's quotas (organization admins). Quotas not given keep
    their value; none removes a limit."""
    given = {
        "standard_gpus": standard_gpus,
        "preemptible_gpus": preemptible_gpus,
        "clusters": clusters,
        "volume_tib": volume_tib,
    }
    if all(v is None for v in given.values()):
        raise typer.BadParameter("give at least one quota to set")
    with open_client(project) as client:
        current = client.projects.quota().limits.model_dump()
        for name, value in given.items():
            if value is not None:
                current[name] = _limit(value, name.replace("_", "-"))
        q = client.projects.set_quota(current)
    emit(output, q, render=lambda: quota_view(q))


@members_app.command("list")
@api_command
def members_list(*, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE) -> None:
    """List the project's members, their roles and Unix uids."""
    with open_client(project) as client:
        members = client.projects.members()
    emit(output, members, render=lambda: members_table(members), empty="no members")


@members_app.command("remove")
@api_command
def members_remove(
    user: Annotated[str, typer.Argument(help="user name (see `projects members list`)")],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Remove a user from the project (project or org admins). They can no
    longer log in to its clusters (within a minute); their files stay."""
    with open_client(project) as client:
        removed = client.projects.remove_member(user)
        name = client.project
    emit(
        output,
        removed,
        render=lambda: Text(f"removed {removed.user} ({removed.role.value}) from project {name}"),
    )


@users_app.command("list")
@api_command
def users_list(
    *,
    include_deleted: Annotated[
        bool, typer.Option("--include-deleted", help="also list deleted users")
    ] = False,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """List the organization's users, their uids and projects."""
    with open_client() as client:
        users = client.users.list(include_deleted=include_deleted)
    emit(output, users, render=lambda: users_table(users), empty="no users")


@users_app.command("delete")
@api_command
def users_delete(
    name: Annotated[str, typer.Argument(help="user name (see `users list`)")],
    *,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Delete a user: revoke their API keys and SSH keys and remove them from
    every project. Their uid and name are never reused; their files stay."""
    with open_client() as client:
        user = client.users.delete(name)
    emit(
        output,
        user,
        render=lambda: Text(
            f"deleted user {user.name}: API keys revoked, SSH keys removed, no longer a "
            f"member of any project; uid {optional(user.uid)} stays reserved"
        ),
    )


@api_keys_app.command("create")
@api_command
def api_keys_create(
    *,
    user: Annotated[str, typer.Option("--user", help="user name (created if new)")],
    project: Annotated[str, typer.Option("--project", "-p", help="project the key acts in")],
    role: Annotated[ProjectRole, typer.Option("--role", case_sensitive=False)] = (
        ProjectRole.EDITOR
    ),
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Issue an API key for a user in a project. The key is shown only once."""
    with open_client() as client:
        created = client.api_keys.create({"user": user, "project": project, "role": role.value})
    emit(output, created, render=lambda: api_key_view(created))
    stderr_console().print(
        "This key is shown only once; store it now (for example as GPUCLUSTERS_API_KEY).",
        style="yellow",
    )


@hosts_app.command("list")
@api_command
def hosts_list(
    limit: LimitOpt = None, cursor: CursorOpt = None, output: OutputOpt = OutputFormat.TABLE
) -> None:
    """List the fleet's hosts and what runs on them (every page, or one
    with --limit / --cursor)."""
    with open_client() as client:
        hosts, next_cursor = one_or_every_page(
            limit,
            cursor,
            every=client.hosts.list,
            page=lambda n, c: client.hosts.page(limit=n, cursor=c),
        )
    emit(output, hosts, render=lambda: hosts_table(hosts), empty="no hosts")
    note_next_page(next_cursor)


@hosts_app.command("get")
@api_command
def hosts_get(
    name: Annotated[str, typer.Argument(help="host name")], output: OutputOpt = OutputFormat.TABLE
) -> None:
    """Show one host and the node on it."""
    with open_client() as client:
        host = client.hosts.get(name)
    emit(output, host, render=lambda: hosts_table([host]))


HostArg = Annotated[str, typer.Argument(help="host name (see `hosts list`)")]


def _host_action(action: str, name: str, output: OutputFormat) -> None:
    with open_client() as client:
        host = getattr(client.hosts, action)(name)
    emit(output, host, render=lambda: hosts_table([host]))


@hosts_app.command("reclaim")
@api_command
def hosts_reclaim(name: HostArg, output: OutputOpt = OutputFormat.TABLE) -> None:
    """Take a host back from the preemptible pool: preempt the node on it
    (five-minute protocol) and cordon it. `hosts uncordon` gives it back."""
    _host_action("reclaim", name, output)


@hosts_app.command("cordon")
@api_command
def hosts_cordon(name: HostArg, output: OutputOpt = OutputFormat.TABLE) -> None:
    """Place nothing new on a host; what runs there keeps running."""
    _host_action("cordon", name, output)


@hosts_app.command("uncordon")
@api_command
def hosts_uncordon(name: HostArg, output: OutputOpt = OutputFormat.TABLE) -> None:
    """Make a host available again (spare capacity for preemptible nodes)."""
    _host_action("uncordon", name, output)


@hosts_app.command("drain")
@api_command
def hosts_drain(name: HostArg, output: OutputOpt = OutputFormat.TABLE) -> None:
    """Empty a host: cordon it, preempt a preemptible node (with notice) and
    move a standard node to another host (an approved migrate repair)."""
    _host_action("drain", name, output)


@hosts_app.command("remove")
@api_command
def hosts_remove(
    name: HostArg,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="the host is gone for good: remove it with its nodes (they fail with the "
            "reason); needs --reason",
        ),
    ] = False,
    reason: ReasonOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Take a host with a host agent out of the fleet (it must hold no node:
    drain it first, or --force for a host that is gone for good). Its
    agent's credentials stop working."""
    force_reason = forced_reason(force, reason)
    with open_client() as client:
        host = client.hosts.remove(name, force_reason=force_reason)
    emit(output, host, render=lambda: hosts_table([host]))


@gpu_types_app.command("list")
@api_command
def gpu_types_list(output: OutputOpt = OutputFormat.TABLE) -> None:
    """List GPU types and free capacity."""
    with open_client() as client:
        types = client.gpu_types.list()
    emit(output, types, render=lambda: gpu_types_table(types), empty="no GPU types")


@regions_app.command("list")
@api_command
def regions_list(output: OutputOpt = OutputFormat.TABLE) -> None:
    """List regions."""
    with open_client() as client:
        regions = client.regions.list()
    emit(output, regions, render=lambda: regions_table(regions), empty="no regions")


@api_command
def whoami(output: OutputOpt = OutputFormat.TABLE) -> None:
    """Show who the configured API key belongs to."""
    with open_client() as client:
        me = client.whoami()
        url = client.url
    emit(output, me, render=lambda: whoami_view(me, url=url))


@hosts_app.command("join-token")
@api_command
def hosts_join_token(
    name: Annotated[str, typer.Argument(help="the host's name in the fleet")],
    ib_island: Annotated[str | None, typer.Option("--ib-island")] = None,
    region: Annotated[str | None, typer.Option("--region")] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """A one-use token for a host agent to join with, for installing a host
    by hand (`hosts add` makes and uses one itself): run
    `gpuclusters host-agent join --server URL --token T --ca-fingerprint FP ...`
    on the host."""
    with open_client() as client:
        token = client.hosts.join_token(name, region=region, ib_island=ib_island)
    emit(
        output,
        token,
        render=lambda: details(
            [
                ("name", token.name),
                ("token", token.token),
                ("expires", clock(token.expires_at)),
                ("server", optional(token.server_url)),
                ("ca fingerprint", optional(token.ca_fingerprint)),
            ]
        ),
    )


budget_app = typer.Typer(
    help="A project's budget: money per month or a prepaid credit, alerts at 50/80/100%, "
    "and what happens once it is spent (docs/budgets.md).",
    no_args_is_help=True,
)
projects_app.add_typer(budget_app, name="budget")


def budget_view(b: ProjectBudget) -> RenderableType:
    if b.budget is None:
        return Text(f"project {b.project}: no budget")
    rows = [
        ("budget", f"{b.budget.amount:.2f} {b.currency} {b.budget.kind}"),
        ("policy", f"{b.budget.policy} once spent"),
        (
            "spent",
            f"{b.spent:.2f} {b.currency} ({b.percent:.1f}%) since "
            + (clock(b.period_start) if b.period_start else "-"),
        ),
        ("remaining", f"{(b.remaining or 0):.2f} {b.currency}"),
        ("enforced", b.enforced or "no"),
        ("grace ends", clock(b.grace_ends_at) if b.grace_ends_at else "-"),
        ("webhook", b.budget.webhook_url or "-"),
    ]
    parts: list[RenderableType] = [details(rows)]
    if b.alerts:
        t = table("TIME", "ALERT", "MESSAGE")
        for a in b.alerts:
            t.add_row(clock(a.timestamp), f"{a.kind} {a.percent}%", a.message)
        parts += [Text(""), t]
    return Group(*parts)


@budget_app.command("get")
@api_command
def budget_get(*, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE) -> None:
    """The project's budget, what was spent in its period, and its alerts."""
    with open_client(project) as client:
        b = client.projects.budget()
    emit(output, b, render=lambda: budget_view(b))


@budget_app.command("set")
@api_command
def budget_set(
    *,
    monthly: Annotated[
        float | None,
        typer.Option("--monthly", help="money per calendar month (UTC)", show_default=False),
    ] = None,
    credit: Annotated[
        float | None,
        typer.Option(
            "--credit", help="a prepaid credit, counted from now (a top-up)", show_default=False
        ),
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help="once spent: pause (no new nodes) or stop")
    ] = "pause",
    webhook: Annotated[
        str | None,
        typer.Option("--webhook", help="URL POSTed each alert as JSON", show_default=False),
    ] = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Set the project's budget (organization admins): --monthly N or --credit N."""
    if (monthly is None) == (credit is None):
        raise typer.BadParameter("give one of --monthly or --credit", param_hint="--monthly")
    body = {
        "kind": "monthly" if monthly is not None else "credit",
        "amount": monthly if monthly is not None else credit,
        "policy": policy,
        "webhook_url": webhook,
    }
    with open_client(project) as client:
        b = client.projects.set_budget(body)
    emit(output, b, render=lambda: budget_view(b))


@budget_app.command("delete")
@api_command
def budget_delete(*, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE) -> None:
    """Remove the project's budget (organization admins)."""
    with open_client(project) as client:
        b = client.projects.delete_budget()
    emit(output, b, render=lambda: budget_view(b))
