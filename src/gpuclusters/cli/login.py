"""``gpuclusters login``: point the CLI at a server from your own machine.

Checks the URL and the API key by asking the server who the key belongs to
(``GET /v1/whoami``), and only then writes ``$GPUCLUSTERS_HOME/config.toml``
(URL, key, project and, for a server with a CA of its own, ``ca_file``).
A login that fails writes nothing.

An https server is trusted by one of:

* ``--ca-file FILE``: its CA certificate, as the operator handed it out;
* ``--ca-fingerprint SHA256``: the CA's SHA-256 fingerprint, as ``gpuclusters
  up`` prints it; the CA is fetched from ``/v1/tls/ca.pem`` without
  verification, kept only if its fingerprint matches, then used to verify;
* neither: the system's trust store (an operator's certificate from a public
  CA).

The CA is copied to ``$GPUCLUSTERS_HOME/ca.pem`` and every later command
verifies the server with it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from gpuclusters.cli.context import OutputFormat, OutputOpt, api_command, stderr_console
from gpuclusters.cli.org import whoami_view
from gpuclusters.cli.render import emit
from gpuclusters.client import Client
from gpuclusters.client.client import fetch_ca_certificate
from gpuclusters.core.clientconfig import (
    DEFAULT_PROJECT,
    default_home,
    write_ca_file,
    write_config,
)
from gpuclusters.core.errors import NotFoundError, ValidationError
from gpuclusters.core.models import WhoAmI


def _server_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValidationError(
            f"--url must look like https://HOST:PORT, got {url.strip()!r}", field="url"
        )
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValidationError(
            f"--url is the server's address only (https://HOST:PORT), got {url.strip()!r}",
            field="url",
        )
    return f"{parts.scheme}://{parts.netloc}"


def _read_ca_file(path: Path) -> bytes:
    try:
        data = path.expanduser().read_bytes()
    except OSError as exc:
        raise ValidationError(f"--ca-file {path}: {exc.strerror or exc}", field="ca_file") from exc
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValidationError(f"--ca-file {path} is not a PEM certificate", field="ca_file")
    return data


def _choose_project(me: WhoAmI, wanted: str | None) -> str:
    if wanted is not None:
        if wanted not in me.projects:
            yours = ", ".join(sorted(me.projects)) or "none"
            raise NotFoundError(
                f"project {wanted!r} not found, or {me.user} is not a member of it "
                f"(yours: {yours})",
                field="project",
            )
        return wanted
    if DEFAULT_PROJECT in me.projects or not me.projects:
        return DEFAULT_PROJECT
    return sorted(me.projects)[0]


@api_command
def login(
    *,
    url: Annotated[
        str,
        typer.Option(
            "--url", show_default=False, help="the server's address, e.g. https://HOST:8443"
        ),
    ],
    api_key: Annotated[
        str,
        typer.Option(
            "--api-key",
            envvar="GPUCLUSTERS_API_KEY",
            prompt="API key",
            hide_input=True,
            show_default=False,
            help="your API key (gpc_...); asked for when not given",
        ),
    ],
    ca_file: Annotated[
        Path | None,
        typer.Option(
            "--ca-file",
            show_default=False,
            help="the server's CA certificate (PEM), from its operator",
        ),
    ] = None,
    ca_fingerprint: Annotated[
        str | None,
        typer.Option(
            "--ca-fingerprint",
            show_default=False,
            help="the SHA-256 fingerprint of the server's CA (AB:CD:...), from its operator; "
            "the CA is fetched from the server and checked against it",
        ),
    ] = None,
    project: Annotated[
        str | None,
        typer.Option(
            "--project",
            "-p",
            show_default=False,
            help="project to act in (default: 'default' if you are a member, else your first)",
        ),
    ] = None,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Log in to a gpuclusters server: check the URL and API key, then save
    them (and the server's CA) for later commands."""
    server = _server_url(url)
    if ca_file is not None and ca_fingerprint is not None:
        raise ValidationError(
            "give --ca-file or --ca-fingerprint, not both", field="ca_fingerprint"
        )
    if (ca_file is not None or ca_fingerprint is not None) and not server.startswith("https:"):
        raise ValidationError(
            f"--ca-file and --ca-fingerprint are for an https:// URL, got {server}", field="url"
        )
    api_key = api_key.strip()
    if not api_key:
        raise ValidationError("--api-key is empty", field="api_key")

    ca_pem: bytes | None = None
    if ca_file is not None:
        ca_pem = _read_ca_file(ca_file)
    elif ca_fingerprint is not None:
        ca_pem = fetch_ca_certificate(server, fingerprint=ca_fingerprint)

    # Verify with exactly what will be stored: the CA from a file of our own.
    with tempfile.TemporaryDirectory(prefix="gpuclusters-login-") as tmp:
        trial_ca: Path | None = None
        if ca_pem is not None:
            trial_ca = Path(tmp) / "ca.pem"
            trial_ca.write_bytes(ca_pem)
        with Client(server, api_key, project or DEFAULT_PROJECT, ca_file=trial_ca) as client:
            me = client.whoami()
    chosen = _choose_project(me, project)

    home = default_home()
    stored_ca = str(write_ca_file(home, ca_pem).resolve()) if ca_pem is not None else None
    path = write_config(home, url=server, api_key=api_key, project=chosen, ca_file=stored_ca)
    emit(output, me, render=lambda: whoami_view(me, url=server))
    stderr_console().print(
        f"logged in to {server} as {me.user} (project {chosen}); saved in {path}"
        + (f", CA in {stored_ca}" if stored_ca else ""),
        soft_wrap=True,
    )
