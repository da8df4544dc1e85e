"""``gpuclusters clusters ...``: create, list, get, scale, delete, ssh,
configure, credentials.

Request bodies are built as plain dicts and validated by the server, so the
CLI shows exactly the API's ``invalid_input`` messages and never drifts from
the server's rules. ``--wait`` polls through :meth:`ClustersAPI.wait` with a
:class:`~gpuclusters.cli.progress.WaitProgress` on stderr, then prints the
final object on stdout; a failed cluster exits with status 1.

``credentials`` fetches a kubeconfig and merges it into a kubeconfig file
(:mod:`gpuclusters.cli.kubefile`, :mod:`gpuclusters.core.kubeconfig`); the
existing file is checked before anything is fetched, and only the cluster's
own entries change.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from datetime import UTC
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from gpuclusters.cli import context, kubefile, ssh_keys
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
)
from gpuclusters.cli.nodes import nodes_table
from gpuclusters.cli.progress import WaitProgress
from gpuclusters.cli.render import (
    age,
    attempt_rows,
    clock,
    details,
    emit,
    live_nodes,
    node_summary,
    optional,
    print_json,
    state,
    table,
)
from gpuclusters.client import Client
from gpuclusters.client.errors import UnexpectedResponseError
from gpuclusters.core import kubeconfig
from gpuclusters.core.clientconfig import default_home
from gpuclusters.core.enums import BillingType, ClusterType, NodePhase
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.models import Cluster, ClusterCredentials

app = typer.Typer(help="Create, inspect, scale and delete clusters.", no_args_is_help=True)


class Billing(StrEnum):
    ON_DEMAND = "on-demand"
    RESERVED = "reserved"
    SCHEDULED = "scheduled"


BILLING_TYPES = {
    Billing.ON_DEMAND: BillingType.ON_DEMAND,
    Billing.RESERVED: BillingType.RESERVED,
    Billing.SCHEDULED: BillingType.SCHEDULED_CAPACITY,
}

WaitTimeoutOpt = Annotated[
    float | None,
    typer.Option("--wait-timeout", min=0, show_default=False, help="give up waiting after SECONDS"),
]


def clusters_table(clusters: list[Cluster]) -> RenderableType:
    t = table("NAME", "TYPE", "GPU_TYPE", "GPUS", "PREEMPTIBLE", "STATUS", "NODES", "AGE")
    for c in clusters:
        live = live_nodes(c.nodes)
        running = sum(1 for n in live if n.phase is NodePhase.RUNNING)
        t.add_row(
            c.name,
            c.cluster_type.value,
            c.gpu_type,
            str(c.num_gpus),
            f"{c.allocated_preemptible_gpus}/{c.desired_preemptible_gpus}",
            state(c.status),
            f"{running}/{len(live)}",
            age(c.created_at),
        )
    return t


def cluster_detail(c: Cluster) -> RenderableType:
    status = state(c.status)
    if c.status_message:
        status.append(f"  {c.status_message}", style="")
    reservation = (
        f"{clock(c.reservation_start)} .. {clock(c.reservation_end)}"
        if c.reservation_start and c.reservation_end
        else "-"
    )
    info = details(
        [
            ("name", c.name),
            ("project", c.project),
            ("type", c.cluster_type.value),
            ("status", status),
            *attempt_rows(
                retries=c.retries,
                last_error=c.last_error,
                next_attempt_at=c.next_attempt_at,
                phase_deadline_at=c.phase_deadline_at,
            ),
            ("delete forced", optional(c.force_delete_reason)),
            ("region", c.region),
            ("gpu type", c.gpu_type),
            ("gpus", str(c.num_gpus)),
            (
                "autoscaling",
                f"{c.autoscaling.min_gpus}-{c.autoscaling.max_gpus} GPUs, nodes released "
                f"after {c.autoscaling.idle_s} s idle"
                if c.autoscaling
                else "off",
            ),
            (
                "preemptible gpus",
                f"{c.allocated_preemptible_gpus} allocated / {c.desired_preemptible_gpus} "
                f"desired (requested {c.num_preemptible_gpus})",
            ),
            ("billing", c.billing_type.value),
            (
                "capacity",
                f"{c.capacity.reserved_gpus} reserved, {c.capacity.pool_gpus} pool, "
                f"{c.capacity.on_demand_gpus} on-demand GPUs"
                if c.capacity
                else "-",
            ),
            ("reservation", reservation),
            ("starts", clock(c.start_at) if c.start_at else "-"),
            ("volume", optional(c.volume)),
            ("cuda / driver", f"{optional(c.cuda_version)} / {optional(c.driver_version)}"),
            ("nodes", node_summary(c.nodes)),
            (
                "ssh",
                f"ssh -p {c.ssh_endpoint.port} USER@{c.ssh_endpoint.host}"
                if c.ssh_endpoint
                else "-",
            ),
            ("kubernetes api", optional(c.kubernetes_endpoint)),
            ("egress", "on" if c.egress else "off"),
            ("created", f"{clock(c.created_at)} ({age(c.created_at)} ago)"),
        ]
    )
    parts: list[RenderableType] = [info]
    if c.phase_history:
        phases = table("TIME", "PHASE", "MESSAGE")
        for p in c.phase_history:
            phases.add_row(clock(p.timestamp), p.phase, p.message)
        parts += [Text(""), Text("Phases", style="bold"), phases]
    if c.nodes:
        parts += [Text(""), Text("Nodes", style="bold"), nodes_table(c.nodes)]
    return Group(*parts)


def _show(output: OutputFormat, cluster: Cluster) -> None:
    emit(output, cluster, render=lambda: cluster_detail(cluster))


# Autoscaling's options, on create (--autoscale-max turns it on) and
# configure (a new range for an autoscaled cluster): docs/autoscaling.md.
AutoscaleMinOpt = Annotated[
    int | None,
    typer.Option(
        "--autoscale-min",
        help="autoscaling: fewest standard GPUs (on create, default --gpus)",
        show_default=False,
    ),
]
AutoscaleMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--autoscale-max",
        help="autoscaling: most standard GPUs (on create, turns autoscaling on)",
        show_default=False,
    ),
]
AutoscaleIdleOpt = Annotated[
    int | None,
    typer.Option(
        "--autoscale-idle",
        help="autoscaling: seconds a node stays idle before it is released (default 600)",
        show_default=False,
    ),
]


@app.command("create")
@api_command
def create(
    name: Annotated[str, typer.Argument(help="cluster name: a DNS label")],
    *,
    cluster_type: Annotated[
        ClusterType, typer.Option("--type", case_sensitive=False, help="cluster flavour")
    ],
    gpus: Annotated[int, typer.Option("--gpus", help="standard GPUs, a multiple of 8")],
    gpu_type: Annotated[str, typer.Option("--gpu-type")] = "H100_SXM",
    preemptible_gpus: Annotated[
        int, typer.Option("--preemptible-gpus", help="extra preemptible GPUs, a multiple of 8")
    ] = 0,
    billing: Annotated[Billing, typer.Option("--billing", case_sensitive=False)] = (
        Billing.ON_DEMAND
    ),
    reservation_start: Annotated[
        str | None, typer.Option("--reservation-start", help="ISO 8601 time", show_default=False)
    ] = None,
    reservation_end: Annotated[
        str | None, typer.Option("--reservation-end", help="ISO 8601 time", show_default=False)
    ] = None,
    start_at: Annotated[
        str | None,
        typer.Option(
            "--start-at",
            help="queue the request to start then (ISO 8601); scheduled clusters use "
            "--reservation-start",
            show_default=False,
        ),
    ] = None,
    queue: Annotated[
        bool,
        typer.Option(
            "--queue", help="if capacity is short, queue until it fits instead of failing"
        ),
    ] = False,
    region: Annotated[
        str | None,
        typer.Option("--region", help="region (default: the server's)", show_default=False),
    ] = None,
    volume: Annotated[
        str | None,
        typer.Option("--volume", help="attach this existing volume", show_default=False),
    ] = None,
    volume_size_tib: Annotated[
        int | None,
        typer.Option("--volume-size-tib", help="create a new volume of N TiB", show_default=False),
    ] = None,
    cuda_version: Annotated[str | None, typer.Option("--cuda-version", show_default=False)] = None,
    driver_version: Annotated[
        str | None, typer.Option("--driver-version", show_default=False)
    ] = None,
    egress: Annotated[
        bool,
        typer.Option(
            "--egress/--no-egress",
            help="let nodes reach networks outside the machine (pip install, image pulls)",
        ),
    ] = True,
    wait: Annotated[bool, typer.Option("--wait", help="wait until ready (or failed)")] = False,
    autoscale_min: AutoscaleMinOpt = None,
    autoscale_max: AutoscaleMaxOpt = None,
    autoscale_idle: AutoscaleIdleOpt = None,
    wait_timeout: WaitTimeoutOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Create a cluster (and optionally wait until it is ready). With
    --autoscale-max its standard GPUs follow the Slurm queue between
    --autoscale-min (default --gpus) and --autoscale-max."""
    spec: dict[str, Any] = {
        "name": name,
        "cluster_type": cluster_type.value,
        "gpu_type": gpu_type,
        "num_gpus": gpus,
        "num_preemptible_gpus": preemptible_gpus,
        "billing_type": BILLING_TYPES[billing].value,
        "egress": egress,
    }
    if queue:
        spec["queue_if_unavailable"] = True
    optional_fields = {
        "reservation_start": reservation_start,
        "reservation_end": reservation_end,
        "start_at": start_at,
        "region": region,
        "volume": volume,
        "volume_size_tib": volume_size_tib,
        "cuda_version": cuda_version,
        "driver_version": driver_version,
    }
    spec.update({k: v for k, v in optional_fields.items() if v is not None})
    if autoscale_max is not None:
        autoscaling: dict[str, int] = {
            "min_gpus": gpus if autoscale_min is None else autoscale_min,
            "max_gpus": autoscale_max,
        }
        if autoscale_idle is not None:
            autoscaling["idle_s"] = autoscale_idle
        spec["autoscaling"] = autoscaling
    elif autoscale_min is not None or autoscale_idle is not None:
        raise typer.BadParameter(
            "--autoscale-min and --autoscale-idle need --autoscale-max (it turns autoscaling on)",
            param_hint="--autoscale-max",
        )
    with open_client(project) as client:
        cluster = client.clusters.create(spec)
        if wait:
            cluster = _wait_ready(client, cluster, wait_timeout)
    _show(output, cluster)


def _wait_ready(client: Client, cluster: Cluster, timeout: float | None) -> Cluster:
    """Poll until ``cluster`` is ready (or failed), with progress on stderr."""
    name = cluster.name
    with WaitProgress(name, goal="ready") as progress:
        progress.update(cluster)
        cluster = client.clusters.wait(
            name,
            until="ready",
            on_change=progress.update,
            timeout=timeout,
            interval=context.POLL_INTERVAL_S,
        )
        progress.done(f"cluster {name} is {cluster.status.value}: {node_summary(cluster.nodes)}")
    return cluster


@app.command("list")
@api_command
def list_(
    *,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """List the project's clusters (every page, or one with --limit / --cursor)."""
    with open_client(project) as client:
        clusters, next_cursor = one_or_every_page(
            limit,
            cursor,
            every=client.clusters.list,
            page=lambda n, c: client.clusters.page(limit=n, cursor=c),
        )
        emit(
            output,
            clusters,
            render=lambda: clusters_table(clusters),
            empty=f"no clusters in project {client.project}",
        )
        note_next_page(next_cursor)


@app.command("get")
@api_command
def get(
    name: Annotated[str, typer.Argument()],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Show one cluster with its phase history and nodes."""
    with open_client(project) as client:
        cluster = client.clusters.get(name)
    _show(output, cluster)


@app.command("scale")
@api_command
def scale(
    name: Annotated[str, typer.Argument()],
    *,
    gpus: Annotated[
        int | None, typer.Option("--gpus", help="new standard GPU count", show_default=False)
    ] = None,
    preemptible_gpus: Annotated[
        int | None,
        typer.Option("--preemptible-gpus", help="new preemptible GPU count", show_default=False),
    ] = None,
    reservation_end: Annotated[
        str | None,
        typer.Option(
            "--reservation-end", help="extend a reservation (ISO 8601)", show_default=False
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="wait until ready again (a scale-up's nodes joined)"),
    ] = False,
    wait_timeout: WaitTimeoutOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Change a cluster's GPU counts (or extend its reservation)."""
    changes: dict[str, Any] = {
        k: v
        for k, v in {
            "num_gpus": gpus,
            "num_preemptible_gpus": preemptible_gpus,
            "reservation_end": reservation_end,
        }.items()
        if v is not None
    }
    if not changes:
        raise typer.BadParameter(
            "give at least one of --gpus, --preemptible-gpus, --reservation-end"
        )
    with open_client(project) as client:
        cluster = client.clusters.update(name, changes)
        if wait:
            # A scale-up leaves the cluster waiting for its new nodes at
            # once (the update says so); a scale-down keeps it ready while
            # the removed nodes drain.
            cluster = _wait_ready(client, cluster, wait_timeout)
    _show(output, cluster)


@app.command("delete")
@api_command
def delete(
    name: Annotated[str, typer.Argument()],
    *,
    delete_volume: Annotated[
        bool, typer.Option("--delete-volume", help="also delete the cluster's volume")
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="wait until it is gone")] = False,
    wait_timeout: WaitTimeoutOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="organization admins: skip the release steps that fail (each is recorded "
            "as an event) instead of retrying them; needs --reason",
        ),
    ] = False,
    reason: ReasonOpt = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="accepted for scripts; delete never prompts")
    ] = False,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Delete a cluster (never prompts). A delete always finishes: steps that
    cannot work are skipped with an event, at once where the cluster never
    came up, else at the deadline (or at once with --force)."""
    del yes  # deletion is always non-interactive
    force_reason = forced_reason(force, reason)
    with open_client(project) as client:
        cluster = client.clusters.delete(
            name, delete_volume=delete_volume, force_reason=force_reason
        )
        if not wait:
            _show(output, cluster)
            return
        with WaitProgress(name, goal="deleted") as progress:
            progress.update(cluster)
            last = client.clusters.wait(
                name,
                until="deleted",
                on_change=progress.update,
                timeout=wait_timeout,
                interval=context.POLL_INTERVAL_S,
            )
            progress.done(f"cluster {name} is deleted")
    if output is OutputFormat.JSON:
        # The last state the API reported before it answered 404.
        print_json(last or cluster)


@app.command("ssh")
@api_command
def ssh(
    name: Annotated[str, typer.Argument()],
    command: Annotated[
        list[str] | None, typer.Argument(help="command to run (after --); default: a login shell")
    ] = None,
    *,
    node: Annotated[
        str | None,
        typer.Option(
            "--node",
            help="a node by name, reached through the login node (default: the login node)",
            show_default=False,
        ),
    ] = None,
    as_root: Annotated[
        bool,
        typer.Option(
            "--as-root",
            help="operators on the server machine: a root shell in the node, entered "
            "directly (no SSH; organization admins only)",
        ),
    ] = False,
    project: ProjectOpt = None,
) -> None:
    """Log in to a cluster over SSH as your own Unix account, or run CMD
    there: `gpuclusters clusters ssh demo -- sinfo`.

    The CLI makes a throwaway key, has the server sign it (a short-lived
    certificate) and runs your system ssh to the cluster's login node (with
    --node, on through it to that node); the key is removed afterwards and
    ssh's exit status is passed on. Stdin is passed on too:
    `gpuclusters clusters ssh demo -- sbatch < job.sh`. Host certificates are
    checked against $GPUCLUSTERS_HOME/known_hosts.

    --as-root is the operator's path instead: on the server machine itself,
    a root shell entered directly into the node's namespaces."""
    if as_root:
        with open_client(project) as client:
            target = client.clusters.ssh_target(
                name, node=node, command=list(command or []), as_root=True
            )
        if shutil.which(target.argv[0]) is None:
            raise typer.BadParameter(f"{target.argv[0]} is not installed here", param_hint="ssh")
        sys.stdout.flush()
        sys.stderr.flush()
        # Replace this process: exit status, signals and the terminal belong to
        # the remote command from here on.
        os.execvp(target.argv[0], target.argv)
        return
    with open_client(project) as client:
        status = ssh_keys.certificate_login(client, name, node=node, command=list(command or []))
    raise typer.Exit(status)


def _read_opt_file(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror}") from exc


@app.command("configure")
@api_command
def configure(
    name: Annotated[str, typer.Argument()],
    *,
    slurm_extra_config: Annotated[
        Path | None,
        typer.Option(
            "--slurm-extra-config", help="file of extra slurm.conf lines", show_default=False
        ),
    ] = None,
    prolog: Annotated[
        Path | None, typer.Option("--prolog", help="prolog script file", show_default=False)
    ] = None,
    epilog: Annotated[
        Path | None, typer.Option("--epilog", help="epilog script file", show_default=False)
    ] = None,
    repair_automatic: Annotated[
        str | None,
        typer.Option(
            "--repair-automatic",
            help="faults repaired without approval: comma-separated alert kinds, '*' for "
            "all, '' for none",
            show_default=False,
        ),
    ] = None,
    repair_max_wait: Annotated[
        int | None,
        typer.Option(
            "--repair-max-wait",
            help="seconds a repair waits for the node to be idle before draining it "
            "(-1: never interrupt running work)",
            show_default=False,
        ),
    ] = None,
    egress: Annotated[
        bool | None,
        typer.Option(
            "--egress/--no-egress",
            help="let nodes reach networks outside the machine, or not (applied live)",
            show_default=False,
        ),
    ] = None,
    autoscale_min: AutoscaleMinOpt = None,
    autoscale_max: AutoscaleMaxOpt = None,
    autoscale_idle: AutoscaleIdleOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Change a cluster's own settings: Slurm's (the running cluster is
    reconfigured live), the repair policy, egress and an autoscaled
    cluster's range. Settings not given keep their current value."""
    with open_client(project) as client:
        current = client.clusters.get(name)
        body: dict[str, Any] = {}
        slurm_files = (
            ("extra_config", _read_opt_file(slurm_extra_config)),
            ("prolog", _read_opt_file(prolog)),
            ("epilog", _read_opt_file(epilog)),
        )
        if any(v is not None for _, v in slurm_files):
            settings = current.slurm.model_dump() if current.slurm else {}
            settings.update({k: v for k, v in slurm_files if v is not None})
            body["slurm"] = settings
        if repair_automatic is not None or repair_max_wait is not None:
            repair = current.repair.model_dump() if current.repair else {}
            if repair_automatic is not None:
                repair["automatic"] = [k.strip() for k in repair_automatic.split(",") if k.strip()]
            if repair_max_wait is not None:
                repair["max_wait_s"] = repair_max_wait
            body["repair"] = repair
        if egress is not None:
            body["egress"] = egress
        if any(v is not None for v in (autoscale_min, autoscale_max, autoscale_idle)):
            if current.autoscaling is None:
                raise typer.BadParameter(
                    f"cluster {name} has a fixed size (autoscaling is set at create)",
                    param_hint="--autoscale-max",
                )
            auto = current.autoscaling.model_dump()
            for key, value in (
                ("min_gpus", autoscale_min),
                ("max_gpus", autoscale_max),
                ("idle_s", autoscale_idle),
            ):
                if value is not None:
                    auto[key] = value
            body["autoscaling"] = auto
        if not body:
            raise typer.BadParameter("give at least one setting to change")
        cluster = client.clusters.update(name, body)
    _show(output, cluster)


def cli_command() -> str:
    """This CLI's executable, as an absolute path (kubectl runs the exec
    plugin with its own PATH and working directory)."""
    me = Path(sys.argv[0])
    if me.name == "gpuclusters" and me.is_file() and os.access(me, os.X_OK):
        return str(me.resolve())
    return shutil.which("gpuclusters") or "gpuclusters"


def _runs_this_cli(creds: ClusterCredentials) -> ClusterCredentials:
    """The kubeconfig with its exec plugin pointed at this CLI and this
    CLI's home (its login), so kubectl gets tokens as the same user from
    any shell."""
    try:
        config = kubeconfig.load(creds.kubeconfig)
    except ValueError as exc:
        raise UnexpectedResponseError(f"the server sent an invalid kubeconfig: {exc}") from exc
    env = {"GPUCLUSTERS_HOME": str(default_home().resolve())}
    updated = kubeconfig.with_exec_command(config, cli_command(), env)
    if updated == config:
        return creds
    return creds.model_copy(update={"kubeconfig": kubeconfig.dump(updated)})


@app.command("token")
@api_command
def token(
    name: Annotated[str, typer.Argument()],
    *,
    user: Annotated[
        str | None,
        typer.Option(
            "--user",
            help="refuse unless the token would be this user's (the kubeconfig's own)",
            show_default=False,
        ),
    ] = None,
    project: ProjectOpt = None,
) -> None:
    """A token of minutes on the cluster's Kubernetes API, as an
    ExecCredential: what kubectl runs through the kubeconfig that
    `clusters credentials` writes (you rarely run this yourself)."""
    with open_client(project) as client:
        got = client.clusters.token(name)
    if user is not None and got.user != user:
        raise ValidationError(
            f"this kubeconfig is {user}'s, but the CLI is logged in as {got.user}: "
            f"log in as {user} (gpuclusters login), or get your own (clusters credentials)",
            field="user",
        )
    credential = {
        "apiVersion": kubeconfig.EXEC_API_VERSION,
        "kind": "ExecCredential",
        "status": {
            "token": got.token,
            "expirationTimestamp": got.expires_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }
    typer.echo(json.dumps(credential))


@app.command("credentials")
@api_command
def credentials(
    name: Annotated[str, typer.Argument()],
    *,
    file: Annotated[
        str | None,
        typer.Option(
            "--file",
            "-f",
            metavar="PATH|-",
            help="kubeconfig file to merge into, or - to print the kubeconfig "
            "(default: the first path in $KUBECONFIG, else ~/.kube/config)",
            show_default=False,
        ),
    ] = None,
    context_name: Annotated[
        str | None,
        typer.Option(
            "--context-name",
            help="name of the context (default: the cluster's name)",
            show_default=False,
        ),
    ] = None,
    set_default_context: Annotated[
        bool,
        typer.Option(
            "--set-default-context",
            help="make it the file's current context (otherwise only if the file has none)",
        ),
    ] = False,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Get a kubeconfig for yourself on the cluster's Kubernetes API and merge
    it into your kubeconfig file (other contexts are kept)."""
    path = None if file == "-" else Path(file).expanduser() if file else kubefile.default_path()
    # Refuse a file we could not merge into before a credential is issued.
    existing = kubefile.read(path) if path is not None else None
    with open_client(project) as client:
        creds = client.clusters.credentials(name, context_name=context_name)
    creds = _runs_this_cli(creds)
    if path is None or existing is None:
        if output is OutputFormat.JSON:
            print_json(creds)
        else:
            typer.echo(creds.kubeconfig, nl=not creds.kubeconfig.endswith("\n"))
        return
    try:
        new = kubeconfig.load(creds.kubeconfig)
    except ValueError as exc:
        raise UnexpectedResponseError(f"the server sent an invalid kubeconfig: {exc}") from exc
    merged = kubeconfig.merge(existing, new, set_current=set_default_context)
    kubefile.write(path, kubeconfig.dump(merged))

    use = ["kubectl"]
    if file:
        use += ["--kubeconfig", str(path)]
    if merged["current-context"] != creds.context:
        use += ["--context", creds.context]
    line = f'wrote context "{creds.context}" to {path} (use: {shlex.join([*use, "get", "nodes"])})'
    if output is OutputFormat.JSON:
        print_json(creds)
        context.stderr_console().print(Text(line), soft_wrap=True)
    else:
        typer.echo(line)
