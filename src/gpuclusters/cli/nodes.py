"""``gpuclusters nodes ...`` and ``gpuclusters events``: read-only node views.

Nodes change only through their cluster (``clusters scale``); these commands
show where each node runs and what happened to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.text import Text

from gpuclusters.cli.context import (
    CursorOpt,
    LimitOpt,
    OutputFormat,
    OutputOpt,
    ProjectOpt,
    api_command,
    note_next_page,
    one_or_every_page,
    open_client,
)
from gpuclusters.cli.render import (
    age,
    attempt_rows,
    clock,
    details,
    emit,
    optional,
    state,
    table,
)
from gpuclusters.core.models import Node, NodeEvent

app = typer.Typer(help="Inspect nodes (the 8-GPU machines of a cluster).", no_args_is_help=True)


def _phase(n: Node) -> Text:
    text = state(n.phase)
    if n.cordoned:
        text.append(" (cordoned)", style="yellow")
    return text


def nodes_table(nodes: Sequence[Node]) -> RenderableType:
    t = table("NAME", "CLUSTER", "HOST", "CLASS", "PHASE", "AGE")
    for n in nodes:
        t.add_row(
            n.name, n.cluster, optional(n.host), n.compute_class.value, _phase(n), age(n.created_at)
        )
    return t


def node_detail(n: Node) -> RenderableType:
    return details(
        [
            ("name", n.name),
            ("cluster", n.cluster),
            ("host", optional(n.host)),
            ("class", n.compute_class.value),
            ("phase", _phase(n)),
            ("message", optional(n.message)),
            *attempt_rows(
                retries=n.retries,
                last_error=n.last_error,
                next_attempt_at=n.next_attempt_at,
                phase_deadline_at=n.phase_deadline_at,
            ),
            ("gpus", f"{n.num_gpus} x {n.gpu_type} ({n.gpu_backend or 'unknown'})"),
            ("auto-repair", "on" if n.auto_repair else "off"),
            ("created", clock(n.created_at)),
            ("ready", clock(n.ready_at) if n.ready_at else "-"),
            ("deleted", clock(n.deleted_at) if n.deleted_at else "-"),
        ]
    )


def events_table(events: Sequence[NodeEvent]) -> RenderableType:
    t = table("TIME", "NODE", "REASON", "MESSAGE")
    for e in events:
        message = e.message + (f" (x{e.count})" if e.count > 1 else "")
        t.add_row(clock(e.timestamp), e.node, e.reason, message)
    return t


@app.command("list")
@api_command
def list_(
    *,
    cluster: Annotated[
        str | None, typer.Option("--cluster", help="only this cluster's nodes", show_default=False)
    ] = None,
    include_deleted: Annotated[bool, typer.Option("--all", help="include deleted nodes")] = False,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """List the project's nodes (every page, or one with --limit / --cursor)."""
    with open_client(project) as client:
        nodes, next_cursor = one_or_every_page(
            limit,
            cursor,
            every=lambda: client.nodes.list(cluster, include_deleted=include_deleted),
            page=lambda n, c: client.nodes.page(
                cluster, include_deleted=include_deleted, limit=n, cursor=c
            ),
        )
        emit(
            output,
            nodes,
            render=lambda: nodes_table(nodes),
            empty=f"no nodes in project {client.project}",
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
    """Show one node."""
    with open_client(project) as client:
        node = client.nodes.get(name)
    emit(output, node, render=lambda: node_detail(node))


@app.command("auto-repair")
@api_command
def auto_repair(
    name: Annotated[str, typer.Argument()],
    state: Annotated[str, typer.Argument(help="on or off")],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Turn automatic repair on or off for one node."""
    if state not in ("on", "off"):
        raise typer.BadParameter(f"{state!r}: say on or off", param_hint="STATE")
    with open_client(project) as client:
        node = client.nodes.set_auto_repair(name, state == "on")
    emit(output, node, render=lambda: node_detail(node))


@api_command
def events(
    *,
    cluster: Annotated[
        str | None, typer.Option("--cluster", help="only this cluster", show_default=False)
    ] = None,
    node: Annotated[
        str | None, typer.Option("--node", help="only this node", show_default=False)
    ] = None,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Node lifecycle events (scaling, failures, preemptions), newest first
    (every page, or one with --limit / --cursor)."""
    with open_client(project) as client:
        items, next_cursor = one_or_every_page(
            limit,
            cursor,
            every=lambda: client.events.list(cluster, node=node),
            page=lambda n, c: client.events.page(cluster, node=node, limit=n, cursor=c),
        )
        emit(output, items, render=lambda: events_table(items), empty="no events")
        note_next_page(next_cursor)
