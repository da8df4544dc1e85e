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

``--sso`` signs in through the organization's identity provider instead of
an API key (docs/identity.md): the server starts a device sign-in (RFC 8628),
the CLI prints the provider's page and a code, the user signs in there in
any browser, and the CLI stores the session the server then hands out (an
API key that ends with the session; never a password or a provider token).
``gpuclusters logout`` ends it.
"""

from __future__ import annotations

import tempfile
import time
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
    read_config,
    write_ca_file,
    write_config,
)
from gpuclusters.core.errors import AuthenticationError, NotFoundError, ValidationError
from gpuclusters.core.models import SsoPending, WhoAmI


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


def _sso_session(server: str, project: str | None, ca_file: Path | None) -> str:
    """Sign in at the identity provider (device flow); the session's key."""
    err = stderr_console()
    with Client(server, None, project or DEFAULT_PROJECT, ca_file=ca_file) as client:
        if not client.auth.sso_info().enabled:
            raise ValidationError(
                f"{server} has no single sign-on; log in with an API key (--api-key)",
                field="sso",
            )
        start = client.auth.start_device()
        err.print(
            f"To sign in, open {start.verification_uri_complete or start.verification_uri}\n"
            f"and enter the code [bold]{start.user_code}[/bold] if asked.",
            soft_wrap=True,
        )
        deadline = time.monotonic() + start.expires_in
        interval = max(1, start.interval)
        with err.status("waiting for you to sign in at the identity provider..."):
            while True:
                got = client.auth.poll_device(start.device_code)
                if not isinstance(got, SsoPending):
                    return got.key
                interval = max(interval, got.interval if got.status == "slow_down" else 0)
                if time.monotonic() + interval > deadline:
                    raise AuthenticationError(
                        "the sign-in code expired before you signed in; run the command again"
                    )
                time.sleep(interval)


@api_command
def login(
    *,
    url: Annotated[
        str,
        typer.Option(
            "--url", show_default=False, help="the server's address, e.g. https://HOST:8443"
        ),
    ],
    sso: Annotated[
        bool,
        typer.Option(
            "--sso",
            help="sign in through your organization's identity provider (a browser "
            "page and a code) instead of an API key",
        ),
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="GPUCLUSTERS_API_KEY",
            show_default=False,
            help="your API key (gpc_...); asked for when not given (and not --sso)",
        ),
    ] = None,
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
    """Log in to a gpuclusters server: check the URL and API key (or sign in
    through the identity provider with --sso), then save them (and the
    server's CA) for later commands."""
    server = _server_url(url)
    if ca_file is not None and ca_fingerprint is not None:
        raise ValidationError(
            "give --ca-file or --ca-fingerprint, not both", field="ca_fingerprint"
        )
    if (ca_file is not None or ca_fingerprint is not None) and not server.startswith("https:"):
        raise ValidationError(
            f"--ca-file and --ca-fingerprint are for an https:// URL, got {server}", field="url"
        )
    if sso and api_key:
        raise ValidationError("give --sso or --api-key, not both", field="api_key")
    if not sso and api_key is None:
        api_key = typer.prompt("API key", hide_input=True)
    if not sso and not (api_key or "").strip():
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
        key = _sso_session(server, project, trial_ca) if sso else (api_key or "").strip()
        with Client(server, key, project or DEFAULT_PROJECT, ca_file=trial_ca) as client:
            me = client.whoami()
    chosen = _choose_project(me, project)

    home = default_home()
    stored_ca = str(write_ca_file(home, ca_pem).resolve()) if ca_pem is not None else None
    path = write_config(home, url=server, api_key=key, project=chosen, ca_file=stored_ca)
    emit(output, me, render=lambda: whoami_view(me, url=server))
    stderr_console().print(
        f"logged in to {server} as {me.user} (project {chosen}); saved in {path}"
        + (f", CA in {stored_ca}" if stored_ca else ""),
        soft_wrap=True,
    )


@api_command
def logout() -> None:
    """End your single sign-on session at the server (its key stops working)
    and forget the key here. An API key is left valid at the server (an
    admin revokes those) but forgotten here too."""
    home = default_home()
    stored = read_config(home)
    if not stored.url or not stored.api_key:
        stderr_console().print("not logged in")
        return
    with Client(stored.url, stored.api_key, ca_file=stored.ca_file) as client:
        client.auth.logout()
    write_config(
        home,
        url=stored.url,
        api_key="",
        project=stored.project or DEFAULT_PROJECT,
        ca_file=stored.ca_file,
    )
    stderr_console().print(f"logged out of {stored.url}")
