"""``gpuclusters registry login|info``: push images with the ordinary clients.

The server's image registry (docs/kubernetes.md "Images") takes your user
name and API key. ``registry login`` writes them where skopeo, podman and
buildah look (``$REGISTRY_AUTH_FILE``, else ``$XDG_RUNTIME_DIR/containers/
auth.json``, else ``~/.config/containers/auth.json``; the entry for this
registry only, other entries kept) and, when the server's certificate comes
from its own CA, that CA in ``~/.config/containers/certs.d/HOST:PORT/ca.crt``,
so that ``skopeo copy ... docker://HOST:PORT/PROJECT/NAME:TAG`` needs no
flags. Docker reads ``/etc/docker/certs.d`` and ``~/.docker/config.json``
instead: ``docker login HOST:PORT`` with the same user name and key.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import typer

from gpuclusters.cli.context import OutputFormat, OutputOpt, api_command, open_client
from gpuclusters.client.config import ClientConfig
from gpuclusters.core.clientconfig import replace_atomically

app = typer.Typer(help="The image registry: push images your clusters' pods run.")


def auth_file() -> Path:
    """Where containers-auth.json(5) clients read credentials first."""
    explicit = os.environ.get("REGISTRY_AUTH_FILE")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "containers" / "auth.json"
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "containers" / "auth.json"


def certs_dir(address: str) -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "containers" / "certs.d" / address


def write_auth(path: Path, address: str, user: str, password: str) -> None:
    """Add or replace ``address``'s entry, keeping the others."""
    try:
        current = json.loads(path.read_text())
    except FileNotFoundError:
        current = {}
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{path}: not a JSON auth file ({exc})") from exc
    auths = current.setdefault("auths", {})
    auths[address] = {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    replace_atomically(path, (json.dumps(current, indent=2) + "\n").encode(), mode=0o600)


@app.command()
@api_command
def login(output: OutputOpt = OutputFormat.TABLE) -> None:
    """Let skopeo, podman and buildah push to and pull from the registry
    with your API key (no flags needed afterwards)."""
    with open_client() as client:
        info = client.registry()
        me = client.whoami()
        project = client.project
    key = ClientConfig.load().api_key
    if not key:  # the calls above would have failed first; says so for mypy
        raise typer.BadParameter("no API key configured: run gpuclusters login first")
    path = auth_file()
    write_auth(path, info.address, me.user, key)
    ca_path = None
    if info.ca_pem is not None:
        ca_path = certs_dir(info.address) / "ca.crt"
        ca_path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        replace_atomically(ca_path, info.ca_pem.encode(), mode=0o644)
    result = {
        "address": info.address,
        "user": me.user,
        "auth_file": str(path),
        "ca_file": str(ca_path) if ca_path else None,
        "push_to": f"{info.address}/{project}/NAME:TAG",
    }
    if output is OutputFormat.JSON:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"Logged in to {info.address} as {me.user} (credentials in {path}).")
    if ca_path is not None:
        typer.echo(f"Trusting the server's CA for it ({ca_path}).")
    typer.echo(
        f"Push with: skopeo copy oci-archive:IMAGE.tar docker://{info.address}/{project}/NAME:TAG"
    )


@app.command()
@api_command
def info(output: OutputOpt = OutputFormat.TABLE) -> None:
    """Where the registry is."""
    with open_client() as client:
        reg = client.registry()
        project = client.project
    if output is OutputFormat.JSON:
        typer.echo(json.dumps(reg.model_dump(mode="json"), indent=2))
        return
    typer.echo(f"address: {reg.address}")
    typer.echo(f"your project's images: {reg.address}/{project}/NAME:TAG")
    typer.echo(f"token endpoint: {reg.token_url}")
