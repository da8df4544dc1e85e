"""``gpuclusters metrics``: PromQL over your projects' metrics (GPU fields
under dcgm-exporter's names, labelled with the Slurm job or pod on each
GPU; the nodes' CPU, memory, /scratch and network; docs/metrics.md)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import RenderableType

from gpuclusters.cli.context import (
    OutputFormat,
    OutputOpt,
    api_command,
    open_client,
    stderr_console,
)
from gpuclusters.cli.render import stdout_console, table
from gpuclusters.cli.usage import parse_time

app = typer.Typer(no_args_is_help=True, help=__doc__)

# Labels every series of a kind has, left out of the table's SERIES column
# so that what tells series apart shows.
_NOISE = {"job", "instance", "project_id", "cluster_id", "node_id", "UUID", "Hostname"}


def _when(value: str | None, field: str) -> str | None:
    """Unix seconds for the metrics API: ISO 8601, relative (1h, 2d: that
    long ago) or Unix seconds as given."""
    if value is None:
        return None
    if value.replace(".", "", 1).isdigit():
        return value
    parsed = parse_time(value, field=field)
    return None if parsed is None else f"{parsed.timestamp():.3f}"


def _series(labels: dict[str, str]) -> str:
    name = labels.get("__name__", "")
    shown = {k: v for k, v in sorted(labels.items()) if k != "__name__" and k not in _NOISE}
    inner = ",".join(f'{k}="{v}"' for k, v in shown.items())
    return f"{name}{{{inner}}}"


def result_view(answer: dict[str, Any]) -> RenderableType:
    data = answer.get("data") or {}
    kind = data.get("resultType")
    if kind == "matrix":
        t = table("SERIES", "POINTS", "FIRST", "LAST")
        for item in data.get("result", []):
            values = item.get("values") or []
            t.add_row(
                _series(item.get("metric", {})),
                str(len(values)),
                values[0][1] if values else "",
                values[-1][1] if values else "",
            )
        return t
    if kind in ("scalar", "string"):
        return str((data.get("result") or [None, ""])[1])
    t = table("SERIES", "VALUE")
    for item in data.get("result", []):
        t.add_row(_series(item.get("metric", {})), str((item.get("value") or [None, ""])[1]))
    return t


@app.command("query")
@api_command
def query(
    expr: Annotated[str, typer.Argument(help="a PromQL expression")],
    *,
    time: Annotated[
        str | None, typer.Option("--time", help="instant query at: ISO 8601, relative (1h) or Unix")
    ] = None,
    start: Annotated[
        str | None,
        typer.Option("--start", help="range query from: ISO 8601, relative (1h ago) or Unix"),
    ] = None,
    end: Annotated[str | None, typer.Option("--end", help="range query to (default now)")] = None,
    step: Annotated[
        str | None, typer.Option("--step", help="range query resolution (30s, 5m; default auto)")
    ] = None,
    project: Annotated[
        str | None,
        typer.Option("--project", "-p", help="only this project's series (default: all yours)"),
    ] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Query your projects' metrics: an instant query, or a range query with --start."""
    if start is None and (end is not None or step is not None):
        raise typer.BadParameter("--end and --step go with --start", param_hint="--start")
    with open_client() as client:
        if start is not None:
            answer = client.metrics.query_range(
                expr,
                start=_when(start, "start") or start,
                end=_when(end, "end"),
                step=step,
                project=project,
            )
        else:
            answer = client.metrics.query(expr, time=_when(time, "time"), project=project)
    if output is OutputFormat.JSON:
        print(json.dumps(answer, indent=2))
        return
    result = (answer.get("data") or {}).get("result")
    if not result:
        stderr_console().print("no series", style="dim")
        return
    stdout_console().print(result_view(answer))


@app.command("targets")
@api_command
def targets(output: OutputOpt = OutputFormat.TABLE) -> None:
    """The node agents the metrics database scrapes (organization admins)."""
    with open_client() as client:
        found = client.metrics.targets()
    if output is OutputFormat.JSON:
        print(json.dumps(found, indent=2))
        return
    t = table("TARGET", "PROJECT", "CLUSTER", "NODE", "HOST")
    for group in found:
        labels = group.get("labels", {})
        for target in group.get("targets", []):
            t.add_row(target, labels.get("project", ""), labels.get("cluster", ""),
                      labels.get("node", ""), labels.get("host", ""))  # fmt: skip
    stdout_console().print(t)
