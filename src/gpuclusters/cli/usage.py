"""``gpuclusters usage``: GPU-hours and cost per cluster and compute class."""

from __future__ import annotations

import csv
import io
import sys
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from gpuclusters.cli.context import OutputFormat, ProjectOpt, api_command, open_client
from gpuclusters.cli.render import emit, table
from gpuclusters.core.models import UsageReport


def parse_time(value: str | None, *, field: str) -> datetime | None:
    """ISO 8601 (``2026-12-01``, ``2026-12-01T08:00:00Z``) or a relative
    ``<n>h`` / ``<n>d`` meaning that long ago; naive times are UTC."""
    if value is None:
        return None
    text = value.strip()
    if text[:-1].isdigit() and text[-1:] in ("h", "d"):
        unit = timedelta(hours=1) if text[-1] == "h" else timedelta(days=1)
        return datetime.now(UTC) - int(text[:-1]) * unit
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is neither ISO 8601 (2026-12-01T08:00:00Z) nor relative (24h, 7d)",
            param_hint=f"--{field}",
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def usage_view(report: UsageReport) -> RenderableType:
    t = table("CLUSTER", "CLASS", "BILLING", "GPU_TYPE", "NODES", "GPU_HOURS", "RATE/GPU_H", "COST")
    for line in report.lines:
        t.add_row(
            line.cluster,
            line.compute_class.value,
            line.billing,
            line.gpu_type,
            str(line.nodes),
            f"{line.gpu_hours:.3f}",
            f"{line.rate_per_gpu_hour:.4f}",
            f"{line.cost:.2f} {report.currency}",
        )
    head = Text(
        f"project {report.project}, {report.since:%Y-%m-%d %H:%M} to "
        f"{report.until:%Y-%m-%d %H:%M} UTC",
        style="bold",
    )
    total = Text(
        f"total: {report.total_gpu_hours:.3f} GPU-hours, {report.total_cost:.2f} {report.currency}"
    )
    return Group(head, t, total)


class UsageOutput(StrEnum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"


class UsageBy(StrEnum):
    USER = "user"
    CLUSTER = "cluster"


def usage_csv(report: UsageReport) -> str:
    """Spreadsheet rows: per user or cluster with --by, else the priced lines."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    if report.by is not None:
        w.writerow([report.by, "gpu_hours", "cost", "currency"])
        for g in report.groups:
            w.writerow([g.key, f"{g.gpu_hours:.6f}", f"{g.cost:.4f}", report.currency])
    else:
        w.writerow(["cluster", "class", "billing", "gpu_type", "nodes", "gpu_hours",
                    "rate_per_gpu_hour", "cost", "currency"])  # fmt: skip
        for line in report.lines:
            w.writerow([line.cluster, line.compute_class.value, line.billing, line.gpu_type,
                        line.nodes, f"{line.gpu_hours:.6f}", f"{line.rate_per_gpu_hour:.4f}",
                        f"{line.cost:.4f}", report.currency])  # fmt: skip
    return out.getvalue()


def groups_view(report: UsageReport) -> RenderableType:
    t = table((report.by or "").upper(), "GPU_HOURS", "COST")
    for g in report.groups:
        t.add_row(g.key, f"{g.gpu_hours:.3f}", f"{g.cost:.2f} {report.currency}")
    head = Text(
        f"project {report.project} by {report.by}, {report.since:%Y-%m-%d %H:%M} to "
        f"{report.until:%Y-%m-%d %H:%M} UTC",
        style="bold",
    )
    total = Text(
        f"total: {report.total_gpu_hours:.3f} GPU-hours, {report.total_cost:.2f} {report.currency}"
    )
    return Group(head, t, total)


@api_command
def usage(
    *,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            "--from",
            help="start: ISO 8601 or relative (24h, 7d); default 30 days ago",
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", "--to", help="end: ISO 8601 or relative; default now"),
    ] = None,
    by: Annotated[
        UsageBy | None,
        typer.Option("--by", case_sensitive=False, help="totals per user or per cluster"),
    ] = None,
    project: ProjectOpt = None,
    output: Annotated[
        UsageOutput,
        typer.Option("--output", "-o", case_sensitive=False, help="table, json or csv"),
    ] = UsageOutput.TABLE,
) -> None:
    """GPU-hours and cost per cluster and compute class (preemptible at its
    discount), or per user or cluster with --by; CSV for spreadsheets."""
    start, end = parse_time(since, field="since"), parse_time(until, field="until")
    with open_client(project) as client:
        report = client.usage.report(since=start, until=end, by=by.value if by else None)
    if output is UsageOutput.CSV:
        sys.stdout.write(usage_csv(report))
        return
    view = groups_view if report.by else usage_view
    emit(OutputFormat(output.value), report, render=lambda: view(report))
