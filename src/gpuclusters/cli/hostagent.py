"""``gpuclusters host-agent``: the agent of a GPU host (docs/hosts.md).

``join`` turns a join token (from ``gpuclusters hosts add``, which runs it
for you over SSH) into the agent's credentials and configuration; ``run``
is what the systemd unit starts. Like ``gpuclusters server``, the agent's
package is loaded at run time only: the CLI imports no node-making code.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuclusters.core.errors import ValidationError

app = typer.Typer(help="The agent of a GPU host (run on the host, as root).", no_args_is_help=True)

ConfigOpt = Annotated[
    Path,
    typer.Option("--config", help="the agent's configuration file"),
]
DEFAULT_CONFIG = Path("/etc/gpuclusters/host-agent.json")


def _module(name: str) -> Any:
    return importlib.import_module(f"gpuclusters.hostagent.{name}")


@app.command("join")
def join(
    *,
    server: Annotated[str, typer.Option("--server", help="the server's https:// URL")],
    token: Annotated[str, typer.Option("--token", help="the join token (hosts add makes one)")],
    name: Annotated[str, typer.Option("--name", help="this host's name in the fleet")],
    address: Annotated[
        str,
        typer.Option(
            "--address",
            help="this host's address on the network between hosts (the agent listens there; "
            "it is also the end of the clusters' VXLAN segments)",
        ),
    ],
    ca_fingerprint: Annotated[
        str | None, typer.Option("--ca-fingerprint", help="SHA-256 of the server's CA")
    ] = None,
    ca_file: Annotated[
        Path | None, typer.Option("--ca-file", help="the server's CA certificate (PEM)")
    ] = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8471,
    home: Annotated[
        Path, typer.Option("--home", help="node disks and state: put it on the local NVMe")
    ] = Path("/var/lib/gpuclusters-host"),
    volumes_dir: Annotated[
        Path | None,
        typer.Option(
            "--volumes-dir",
            help="the shared filesystem's mount for volumes (the server's volumes_dir)",
        ),
    ] = None,
    ns_dir: Annotated[Path, typer.Option("--ns-dir")] = Path("/run/gpuclusters/ns"),
    node_image: Annotated[
        Path | None,
        typer.Option(
            "--node-image",
            help="the node image nodes boot from (hosts add ships the server's); "
            "default: the host's own directories",
        ),
    ] = None,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Join this host to a gpuclusters server (writes the configuration and
    credentials; `host-agent run` or the systemd unit starts the agent)."""
    cfg_mod, join_mod = _module("config"), _module("join")
    if node_image is not None:
        try:
            importlib.import_module("gpuclusters.linux.nodeimage").check(node_image)
        except ValueError as exc:
            typer.echo(f"error: --node-image: {exc}", err=True)
            raise typer.Exit(1) from exc
    cfg = cfg_mod.AgentConfig(
        name=name,
        server_url=server.rstrip("/"),
        address=address,
        port=port,
        home=str(home),
        ns_dir=str(ns_dir),
        volumes_dir=str(volumes_dir) if volumes_dir else None,
        node_image=str(node_image) if node_image else None,
    )
    try:
        join_mod.join(
            cfg, token=token, config_path=config, ca_fingerprint=ca_fingerprint, ca_file=ca_file
        )
    except join_mod.JoinError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except ValidationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"joined as {name}; configuration in {config}")


@app.command("run")
def run(config: ConfigOpt = DEFAULT_CONFIG) -> None:
    """Run the host agent in the foreground (the systemd unit's command)."""
    cfg_mod = _module("config")
    try:
        _module("main").run(config)
    except cfg_mod.ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
