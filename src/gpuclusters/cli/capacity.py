"""``gpuclusters capacity ...``: reservations and capacity pools set aside
for a project (org admins create and delete; members list their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import RenderableType

from gpuclusters.cli.context import OutputFormat, OutputOpt, api_command, open_client
from gpuclusters.cli.render import clock, emit, table
from gpuclusters.cli.usage import parse_time
from gpuclusters.core.enums import CapacityKind
from gpuclusters.core.models import Capacity

app = typer.Typer(
    help="Reserved capacity and capacity pools set aside for projects.", no_args_is_help=True
)


def capacity_table(items: Sequence[Capacity]) -> RenderableType:
    t = table("NAME", "PROJECT", "KIND", "GPU_TYPE", "REGION", "GPUS", "WINDOWS")
    for c in items:
        windows = ", ".join(
            f"{clock(w.start)} .. {clock(w.end)}{' (active)' if w.active else ''}"
            for w in c.windows
        )
        t.add_row(c.name, c.project, c.kind.value, c.gpu_type, c.region, str(c.num_gpus), windows)
    return t


def _window(text: str) -> dict[str, str]:
    start, sep, end = text.partition("/")
    if not sep:
        raise typer.BadParameter(f"{text!r}: give START/END", param_hint="--window")
    s, e = parse_time(start, field="window"), parse_time(end, field="window")
    assert s is not None and e is not None
    return {"start": s.isoformat(), "end": e.isoformat()}


@app.command("create")
@api_command
def create(
    name: Annotated[str, typer.Argument()],
    *,
    project: Annotated[str, typer.Option("--project", help="the project it is set aside for")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs, a multiple of 8")],
    window: Annotated[
        list[str],
        typer.Option(
            "--window",
            help="START/END in ISO 8601 (e.g. 2026-12-05T00:00Z/2026-12-12T00:00Z); "
            "a pool may have several",
        ),
    ],
    kind: Annotated[CapacityKind, typer.Option("--kind")] = CapacityKind.RESERVED,
    gpu_type: Annotated[str, typer.Option("--gpu-type")] = "H100_SXM",
    region: Annotated[str | None, typer.Option("--region", show_default=False)] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Set capacity aside for a project (org admins)."""
    body = {
        "name": name,
        "project": project,
        "kind": kind.value,
        "gpu_type": gpu_type,
        "region": region,
        "num_gpus": gpus,
        "windows": [_window(w) for w in window],
    }
    with open_client() as client:
        created = client.capacity.create(body)
    emit(output, created, render=lambda: capacity_table([created]))


@app.command("list")
@api_command
def list_(
    *,
    project: Annotated[
        str | None, typer.Option("--project", help="only this project's", show_default=False)
    ] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """List reservations and pools you can see."""
    with open_client() as client:
        items = client.capacity.list(project)
    emit(output, items, render=lambda: capacity_table(items), empty="no capacity set aside")


@app.command("delete")
@api_command
def delete(name: Annotated[str, typer.Argument()]) -> None:
    """Give capacity back (org admins); running clusters keep running."""
    with open_client() as client:
        client.capacity.delete(name)
    typer.echo(f"capacity {name} deleted")
