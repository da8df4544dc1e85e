"""``gpuclusters alerts``, ``health`` and ``repairs``: passive alerts,
active checks and the repair workflow; plus ``nodes inject-fault``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from gpuclusters.cli.context import OutputFormat, OutputOpt, ProjectOpt, api_command, open_client
from gpuclusters.cli.render import clock, details, emit, optional, table
from gpuclusters.core.models import HealthAlert, HealthRun, Repair

alerts_app = typer.Typer(help="Health alerts from the nodes' passive checks.", no_args_is_help=True)
health_app = typer.Typer(
    help="Active health checks (GPU burn, NCCL, storage, ...).", no_args_is_help=True
)
repairs_app = typer.Typer(help="Node repairs: review and follow them.", no_args_is_help=True)

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": ""}
STATE_STYLE = {
    "passed": "green",
    "succeeded": "green",
    "failed": "bold red",
    "skipped": "dim",
    "pending_approval": "yellow",
    "running": "cyan",
    "cancelled": "dim",
    "auto_resolved": "dim",
}


def alerts_table(items: Sequence[HealthAlert]) -> RenderableType:
    t = table("SINCE", "CLUSTER", "NODE", "SEVERITY", "KIND", "GPU", "MESSAGE", "RESOLVED")
    for a in items:
        t.add_row(
            clock(a.started_at),
            a.cluster,
            a.node,
            Text(a.severity, style=SEVERITY_STYLE.get(a.severity, "")),
            a.kind,
            optional(a.gpu),
            a.message,
            clock(a.resolved_at) if a.resolved_at else "-",
        )
    return t


def repairs_table(items: Sequence[Repair]) -> RenderableType:
    t = table("ID", "CLUSTER", "NODE", "ACTION", "STATE", "STEP", "TRIGGER", "REASON")
    for r in items:
        t.add_row(
            r.id,
            r.cluster,
            r.node,
            r.action,
            Text(r.state, style=STATE_STYLE.get(r.state, "")),
            optional(r.step),
            r.trigger,
            r.reason[:80],
        )
    return t


def repair_detail(r: Repair) -> RenderableType:
    return details(
        [
            ("id", r.id),
            ("cluster", r.cluster),
            ("node", r.node),
            ("action", r.action),
            ("state", Text(r.state, style=STATE_STYLE.get(r.state, ""))),
            ("step", optional(r.step)),
            ("trigger", r.trigger),
            ("reason", r.reason),
            ("message", r.message or "-"),
            ("requested by", optional(r.requested_by)),
            ("reviewed by", optional(r.reviewed_by)),
            ("alerts", ", ".join(r.alert_ids) or "-"),
            ("created", clock(r.created_at)),
            ("finished", clock(r.finished_at) if r.finished_at else "-"),
        ]
    )


def runs_table(items: Sequence[HealthRun]) -> RenderableType:
    t = table("ID", "CLUSTER", "NODE", "CHECK", "STATE", "REASON", "METRICS")
    for h in items:
        t.add_row(
            h.id,
            h.cluster,
            h.node,
            h.check,
            Text(h.state, style=STATE_STYLE.get(h.state, "")),
            h.reason or "-",
            json.dumps(h.metrics)[:80] if h.metrics else "-",
        )
    return t


def run_detail(h: HealthRun) -> RenderableType:
    info = details(
        [
            ("id", h.id),
            ("cluster", h.cluster),
            ("node", h.node),
            ("check", h.check),
            ("state", Text(h.state, style=STATE_STYLE.get(h.state, ""))),
            ("reason", h.reason or "-"),
            ("metrics", json.dumps(h.metrics, indent=1) or "-"),
            ("started", clock(h.started_at) if h.started_at else "-"),
            ("finished", clock(h.finished_at) if h.finished_at else "-"),
        ]
    )
    return Group(info, Text(h.output)) if h.output else info


ClusterOpt = Annotated[
    str | None, typer.Option("--cluster", help="only this cluster", show_default=False)
]


@alerts_app.command("list")
@api_command
def alerts_list(
    *,
    cluster: ClusterOpt = None,
    include_resolved: Annotated[bool, typer.Option("--all", help="resolved ones too")] = False,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Open alerts, newest first."""
    with open_client(project) as client:
        items = client.alerts.list(cluster, include_resolved=include_resolved)
    emit(output, items, render=lambda: alerts_table(items), empty="no alerts")


@repairs_app.command("list")
@api_command
def repairs_list(
    *,
    cluster: ClusterOpt = None,
    state: Annotated[str | None, typer.Option("--state", show_default=False)] = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Repair records, newest first."""
    with open_client(project) as client:
        items = client.repairs.list(cluster, state=state)
    emit(output, items, render=lambda: repairs_table(items), empty="no repairs")


def _review(verdict: str, repair_id: str, project: str | None, output: OutputFormat) -> None:
    with open_client(project) as client:
        rem = getattr(client.repairs, verdict)(repair_id)
    emit(output, rem, render=lambda: repair_detail(rem))


RepairId = Annotated[str, typer.Argument(help="repair id (see `repairs list`)")]


@repairs_app.command("approve")
@api_command
def repairs_approve(
    repair_id: RepairId, *, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE
) -> None:
    """Approve a repair waiting for approval (project admins)."""
    _review("approve", repair_id, project, output)


@repairs_app.command("reject")
@api_command
def repairs_reject(
    repair_id: RepairId, *, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE
) -> None:
    """Reject a repair waiting for approval."""
    _review("reject", repair_id, project, output)


@repairs_app.command("cancel")
@api_command
def repairs_cancel(
    repair_id: RepairId, *, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE
) -> None:
    """Cancel a repair that has not started repairing the node yet."""
    _review("cancel", repair_id, project, output)


@health_app.command("run")
@api_command
def health_run(
    cluster: Annotated[str, typer.Argument(help="cluster name")],
    *,
    check: Annotated[
        str,
        typer.Option(
            "--check", help="gpu-burn, gpu-memory-bandwidth, host-device, nccl, storage or ib-write"
        ),
    ],
    node: Annotated[str | None, typer.Option("--node", show_default=False)] = None,
    duration: Annotated[float, typer.Option("--duration", help="seconds (gpu-burn)")] = 60.0,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="wait for the results")] = True,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Run an active check on the cluster's running nodes (or one node)."""
    import time

    body = {"check": check, "node": node, "duration_s": duration}
    with open_client(project) as client:
        runs = client.health.run(cluster, body)
        deadline = time.monotonic() + duration + 600
        while wait and any(r.state in ("pending", "running") for r in runs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
            runs = [client.health.get(r.id) for r in runs]
    emit(output, runs, render=lambda: runs_table(runs))


@health_app.command("list")
@api_command
def health_list(
    *,
    cluster: ClusterOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Active check runs, newest first."""
    with open_client(project) as client:
        items = client.health.list(cluster)
    emit(output, items, render=lambda: runs_table(items), empty="no health checks run")


@health_app.command("show")
@api_command
def health_show(
    run_id: Annotated[str, typer.Argument()],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """One run with its metrics and output."""
    with open_client(project) as client:
        h = client.health.get(run_id)
    emit(output, h, render=lambda: run_detail(h))


@api_command
def inject_fault(
    node: Annotated[str, typer.Argument(help="node name")],
    *,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="xid, ecc-dbe, fell-off-bus, thermal, row-remap, pcie-replay, disk-ro, or clear",
        ),
    ],
    code: Annotated[int | None, typer.Option("--code", help="the Xid", show_default=False)] = None,
    gpu: Annotated[int, typer.Option("--gpu")] = 0,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Inject a simulated fault (embedded fleet only; org admins)."""
    from gpuclusters.cli.nodes import node_detail

    spec = None if kind == "clear" else {"kind": kind, "code": code, "gpu": gpu}
    with open_client(project) as client:
        n = client.health.inject_fault(node, spec)
    emit(output, n, render=lambda: node_detail(n))
