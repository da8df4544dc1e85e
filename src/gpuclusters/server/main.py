"""``gpuclusters server``: run the API server and controllers with uvicorn.

Ctrl-C (SIGINT) or SIGTERM stops accepting requests, stops the reconcilers
after their in-flight steps, and exits; nodes keep running and are
re-adopted at the next start.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError as SettingsValidationError

from gpuclusters.providers.fleet import FleetFileError
from gpuclusters.providers.registry import PROVIDERS
from gpuclusters.server.app import create_app
from gpuclusters.server.settings import Settings


def agent_socket(home: Path) -> socket.socket:
    """The unix socket node agents reach the control plane on. It lives in
    ``$HOME/run``, which providers mount into nodes at
    /run/gpuclusters/control."""
    run_dir = home / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "agent.sock"
    path.unlink(missing_ok=True)  # left by a previous (killed) server
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    # Agents run as root inside nodes; users in nodes have no business here.
    os.chmod(path, 0o600)
    return sock


def run(
    *, host: str | None, port: int | None, provider: str | None, announce: bool = False
) -> None:
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if provider is not None:
        overrides["provider"] = provider
    try:
        settings = Settings(**overrides)
    except SettingsValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        sys.exit(f"error [invalid_input]: setting {field}: {first['msg']}")
    if settings.provider not in PROVIDERS:
        sys.exit(
            f"error [invalid_input]: provider: unknown provider {settings.provider!r}; "
            f"available: {', '.join(sorted(PROVIDERS))}"
        )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the Kubernetes layer's polls would
    # drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = uvicorn.Config(
        create_app(settings, announce=announce),
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    try:
        tcp = config.bind_socket()
    except SystemExit:
        sys.exit(f"error [unavailable]: cannot listen on {settings.host}:{settings.port}")
    settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        server.run(sockets=[tcp, agent_socket(settings.home)])
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it caught once shutdown is complete;
        # a clean stop exits 0 (as `uvicorn.run` does).
        pass
    except FleetFileError as exc:
        sys.exit(f"error [invalid_input]: {exc}")
    if not server.started:
        sys.exit("error [unavailable]: the server did not start; see the log above")
