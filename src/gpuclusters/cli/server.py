"""``gpuclusters server``: run the API server in the foreground.

The CLI must not import the server package (import-linter layers), so the
server module is loaded lazily here, at run time: this command is the one
entry point from the CLI into the server. Options left unset are passed as
``None`` so that the server's own settings (and their defaults: 127.0.0.1,
8470, fake) decide; the server also validates ``--provider`` against the
providers it has, so the CLI keeps no list of its own to drift.

``--public-host`` (``GPUCLUSTERS_PUBLIC_HOST``) names where users reach this
machine; with it the server also serves the API over TLS (docs/operators.md, "API over
TLS"). It is passed on only when set (the server reads the same variable).
"""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from gpuclusters.cli import builds, lifecycle
from gpuclusters.cli.context import api_command

SERVER_MODULE = "gpuclusters.server.main"

PortOpt = Annotated[
    int | None,
    typer.Option(
        "--port",
        envvar="GPUCLUSTERS_PORT",
        min=1,
        max=65535,
        show_default=False,
        help="port to listen on (default: 8470)",
    ),
]
PublicHostOpt = Annotated[
    str | None,
    typer.Option(
        "--public-host",
        envvar="GPUCLUSTERS_PUBLIC_HOST",
        show_default=False,
        help="the name or address users reach this server (and clusters) on; turns on the "
        "API over TLS (default: no TLS, gateways on this machine's primary address)",
    ),
]
EMBEDDED_PROVIDER = "netns"


def _run(**options: object) -> None:
    """Call the server's ``run`` with the options set; an unset
    ``public_host`` is left out, so the server's settings decide."""
    for name in ("public_host", "tls_mode"):
        if options.get(name) is None:
            options.pop(name, None)
    module = importlib.import_module(SERVER_MODULE)
    module.run(**options)


@api_command
def server(
    *,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            envvar="GPUCLUSTERS_HOST",
            show_default=False,
            help="address to listen on (default: 127.0.0.1)",
        ),
    ] = None,
    port: PortOpt = None,
    provider: Annotated[
        str | None,
        typer.Option(
            "--provider",
            envvar="GPUCLUSTERS_PROVIDER",
            show_default=False,
            help="where nodes run: fake, netns (this machine, plus hosts that join) or hosts "
            "(GPU hosts with host agents only; docs/hosts.md) (default: fake)",
        ),
    ] = None,
    public_host: PublicHostOpt = None,
) -> None:
    """Run the gpuclusters API server (and its controllers) in the foreground."""
    _run(host=host, port=port, provider=provider, public_host=public_host)


@api_command
def up(
    *,
    port: PortOpt = None,
    public_host: PublicHostOpt = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            "-d",
            help="run in the background (log: $GPUCLUSTERS_HOME/server.log) and return once "
            "it answers; `gpuclusters down` stops it",
        ),
    ] = False,
) -> None:
    """Start gpuclusters on the embedded fleet (nodes made of Linux
    namespaces on this machine) and say what to do next. Needs root.
    The API is served over TLS too (GPUCLUSTERS_TLS=auto or off to change
    that), which the image registry clusters pull from needs. Ctrl-C stops
    it; clusters come back at the next start."""
    if os.geteuid() != 0:
        raise typer.BadParameter(
            "the embedded fleet makes Linux namespaces, which needs root (try sudo)",
            param_hint="up",
        )
    if detach:
        lifecycle.up_detached(port=port, public_host=public_host)
        return
    # Without TLS there is no image registry, and no cluster could run the
    # README's examples (their images come from it).
    tls_mode = None if os.environ.get("GPUCLUSTERS_TLS") else "on"
    # What scripts/setup still builds in the background, as it goes.
    progress = builds.ProgressPrinter()
    progress.start()
    _run(
        host=None,
        port=port,
        provider=EMBEDDED_PROVIDER,
        public_host=public_host,
        tls_mode=tls_mode,
        announce=True,
    )


@api_command
def down(
    *,
    purge: Annotated[
        bool,
        typer.Option(
            "--purge",
            help="first delete every cluster and volume (their data is gone), then stop, "
            "then remove the host's iptables chains and restore ip_forward",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="seconds to wait for each step")
    ] = 600.0,
) -> None:
    """Stop the server of this GPUCLUSTERS_HOME (nodes keep running, and the
    next `gpuclusters up` adopts them); --purge leaves nothing behind."""
    if os.geteuid() != 0:
        raise typer.BadParameter("the server runs as root: stopping it needs root (try sudo)")
    lifecycle.down(purge, timeout)
