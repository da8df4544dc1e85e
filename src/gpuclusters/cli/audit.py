"""``gpuclusters audit``: who did what, from where, on which object, and
how it ended (organization admins: everything; project admins: their
projects'; docs/identity.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import RenderableType

from gpuclusters.cli.context import (
    CursorOpt,
    LimitOpt,
    OutputFormat,
    OutputOpt,
    api_command,
    note_next_page,
    one_or_every_page,
    open_client,
)
from gpuclusters.cli.render import clock, emit, table
from gpuclusters.cli.usage import parse_time
from gpuclusters.core.models import AuditEvent

app = typer.Typer(no_args_is_help=True, help=__doc__)


def audit_table(events: Sequence[AuditEvent]) -> RenderableType:
    t = table("TIME", "USER", "FROM", "ACTION", "PROJECT", "OBJECT", "OUTCOME")
    for e in events:
        outcome = e.outcome if e.outcome == "ok" else f"{e.outcome} ({e.status})"
        t.add_row(
            clock(e.timestamp),
            e.user or "-",
            e.address,
            e.action if e.via == "api" else f"{e.action} (console)",
            e.project or "-",
            e.object,
            outcome,
        )
    return t


@app.command("list")
@api_command
def list_(
    *,
    user: Annotated[
        str | None, typer.Option("--user", help="only this user's actions", show_default=False)
    ] = None,
    project: Annotated[
        str | None,
        typer.Option("--project", "-p", help="only this project's", show_default=False),
    ] = None,
    object_: Annotated[
        str | None,
        typer.Option(
            "--object", help="only this object and below it, e.g. clusters/demo", show_default=False
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="ISO 8601 or relative (24h, 7d)", show_default=False),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", help="ISO 8601 or relative (1h)", show_default=False),
    ] = None,
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """The audit log, newest first (every page, or one with --limit / --cursor)."""
    start = parse_time(since, field="since")
    end = parse_time(until, field="until")
    with open_client(None) as client:
        items, next_cursor = one_or_every_page(
            limit,
            cursor,
            every=lambda: client.audit.list(
                user=user, project=project, object_=object_, since=start, until=end
            ),
            page=lambda n, c: client.audit.page(
                user=user,
                project=project,
                object_=object_,
                since=start,
                until=end,
                limit=n,
                cursor=c,
            ),
        )
        emit(output, items, render=lambda: audit_table(items), empty="no audit records")
        note_next_page(next_cursor)
