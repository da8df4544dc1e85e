"""``gpuclusters volumes ...``: shared volumes (grow-only, deletable when unbound)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.console import RenderableType

from gpuclusters.cli.context import OutputFormat, OutputOpt, ProjectOpt, api_command, open_client
from gpuclusters.cli.render import age, clock, details, emit, optional, state, table
from gpuclusters.core.models import Volume

app = typer.Typer(help="Manage shared volumes.", no_args_is_help=True)


def volumes_table(volumes: Sequence[Volume]) -> RenderableType:
    t = table("NAME", "REGION", "SIZE_TIB", "STATUS", "CLUSTER", "INDEPENDENT", "AGE")
    for v in volumes:
        t.add_row(
            v.name,
            v.region,
            str(v.size_tib),
            state(v.status),
            optional(v.cluster),
            "yes" if v.is_lifecycle_independent else "no",
            age(v.created_at),
        )
    return t


def volume_detail(v: Volume) -> RenderableType:
    return details(
        [
            ("name", v.name),
            ("project", v.project),
            ("region", v.region),
            ("size", f"{v.size_tib} TiB"),
            ("status", state(v.status)),
            ("cluster", optional(v.cluster)),
            (
                "lifecycle",
                "independent (outlives its cluster)"
                if v.is_lifecycle_independent
                else "deleted with its cluster",
            ),
            ("created", clock(v.created_at)),
        ]
    )


@app.command("list")
@api_command
def list_(*, project: ProjectOpt = None, output: OutputOpt = OutputFormat.TABLE) -> None:
    """List the project's volumes."""
    with open_client(project) as client:
        volumes = client.volumes.list()
        emit(
            output,
            volumes,
            render=lambda: volumes_table(volumes),
            empty=f"no volumes in project {client.project}",
        )


@app.command("create")
@api_command
def create(
    name: Annotated[str, typer.Argument(help="volume name: a DNS label")],
    *,
    size_tib: Annotated[int, typer.Option("--size-tib", help="whole TiB")] = 1,
    region: Annotated[
        str | None,
        typer.Option("--region", help="region (default: the server's)", show_default=False),
    ] = None,
    not_lifecycle_independent: Annotated[
        bool,
        typer.Option(
            "--not-lifecycle-independent", help="delete the volume together with its cluster"
        ),
    ] = False,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Create a volume."""
    spec: dict[str, Any] = {
        "name": name,
        "size_tib": size_tib,
        "is_lifecycle_independent": not not_lifecycle_independent,
    }
    if region is not None:
        spec["region"] = region
    with open_client(project) as client:
        volume = client.volumes.create(spec)
    emit(output, volume, render=lambda: volume_detail(volume))


@app.command("get")
@api_command
def get(
    name: Annotated[str, typer.Argument()],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Show one volume."""
    with open_client(project) as client:
        volume = client.volumes.get(name)
    emit(output, volume, render=lambda: volume_detail(volume))


@app.command("resize")
@api_command
def resize(
    name: Annotated[str, typer.Argument()],
    *,
    size_tib: Annotated[int, typer.Option("--size-tib", help="new size in whole TiB (grow only)")],
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Grow a volume."""
    with open_client(project) as client:
        volume = client.volumes.resize(name, size_tib)
    emit(output, volume, render=lambda: volume_detail(volume))


@app.command("delete")
@api_command
def delete(
    name: Annotated[str, typer.Argument()],
    *,
    project: ProjectOpt = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Delete a volume (refused while a cluster has it bound)."""
    with open_client(project) as client:
        volume = client.volumes.delete(name)
    emit(output, volume, render=lambda: volume_detail(volume))
