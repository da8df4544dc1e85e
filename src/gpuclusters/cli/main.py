"""Entry point of the ``gpuclusters`` console script: assembles the command tree.

Sub-apps come from one module per resource group; ``events``, ``whoami`` and
``server`` are top-level commands. Pretty exceptions never show local
variables (they could include an API key).
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpuclusters import __version__
from gpuclusters.cli import (
    audit,
    builds,
    capacity,
    clusters,
    health,
    hostagent,
    hosts_add,
    login,
    metrics,
    nodes,
    org,
    registry,
    server,
    ssh_keys,
    usage,
    volumes,
)

app = typer.Typer(
    name="gpuclusters",
    help="Self-hostable GPU clusters: create, scale and watch clusters of 8-GPU nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
app.add_typer(clusters.app, name="clusters")
app.add_typer(nodes.app, name="nodes")
app.command("events")(nodes.events)
app.command("usage")(usage.usage)
app.add_typer(metrics.app, name="metrics")
app.add_typer(volumes.app, name="volumes")
app.add_typer(org.hosts_app, name="hosts")
org.hosts_app.command("add")(hosts_add.hosts_add)
app.add_typer(hostagent.app, name="host-agent")
app.add_typer(capacity.app, name="capacity")
app.add_typer(health.alerts_app, name="alerts")
app.add_typer(health.health_app, name="health")
app.add_typer(health.repairs_app, name="repairs")
nodes.app.command("inject-fault")(health.inject_fault)
app.add_typer(org.projects_app, name="projects")
app.add_typer(org.api_keys_app, name="api-keys")
app.add_typer(ssh_keys.app, name="ssh-keys")
app.add_typer(registry.app, name="registry")
app.add_typer(org.users_app, name="users")
app.add_typer(org.gpu_types_app, name="gpu-types")
app.add_typer(org.regions_app, name="regions")
app.add_typer(audit.app, name="audit")
app.command("whoami")(org.whoami)
app.command("login")(login.login)
app.command("logout")(login.logout)
app.command("server")(server.server)
app.command("up")(server.up)
app.command("down")(server.down)
app.command("builds")(builds.builds)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpuclusters {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """Self-hostable GPU clusters: create, scale and watch clusters of 8-GPU nodes."""


def main() -> None:
    app()
