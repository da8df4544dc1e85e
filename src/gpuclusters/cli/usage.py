"""``gpuclusters usage``: GPU-hours and cost per cluster and compute class."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.text import Text

from gpuclusters.cli.context import OutputFormat, OutputOpt, ProjectOpt, api_command, open_client
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


@api_command
def usage(
    *,
    since: Annotated[
        str | None,
        typer.Option("--since", help="start: ISO 8601 or relative (24h, 7d); default 30 days ago"),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="end: ISO 8601 or relative; default now")
    ] = None,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """GPU-hours and cost per cluster and compute class (preemptible at its discount)."""
    start, end = parse_time(since, field="since"), parse_time(until, field="until")
    with open_client(project) as client:
        report = client.usage.report(since=start, until=end)
    emit(output, report, render=lambda: usage_view(report))
