"""``gpuclusters server``: run the API server and controllers with uvicorn.

Ctrl-C (SIGINT) or SIGTERM stops accepting requests, stops the reconcilers
after their in-flight steps, and exits; nodes keep running and are
re-adopted at the next start.

The API listens on plain HTTP at ``host:port`` (and node agents on a unix
socket) and, when TLS is on (``Settings.tls_enabled``), also on HTTPS at
``tls_host:tls_port``. The HTTPS listener is a second ``uvicorn.Server`` on
the same application with ``lifespan="off"``: the main server's lifespan
builds ``app.state.runtime``, so the TLS listener starts only once the main
server has started, and it stops before the main server's lifespan shuts
the runtime down. Only the main server captures SIGINT/SIGTERM (uvicorn's
``capture_signals``); it passes the stop (and a second Ctrl-C's force) on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError as SettingsValidationError

from gpuclusters.core.serverpids import server_pid_file
from gpuclusters.providers.fleet import FleetFileError
from gpuclusters.providers.registry import PROVIDERS
from gpuclusters.server.app import create_app
from gpuclusters.server.security.tls import TlsSetupError, fingerprint, server_tls
from gpuclusters.server.settings import Settings

log = logging.getLogger(__name__)


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
    # Agents run as root inside nodes, which in a user namespace is a host
    # id of the project's block, a different one per project: the socket is
    # open to connect, and each request must carry the node's own token
    # (only its root can read it), so a user in a node gets nothing here.
    os.chmod(path, 0o666)
    return sock


class _Companion(uvicorn.Server):
    """A listener that serves the main server's application: it leaves the
    process's signals to the main server, which tells it when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _MainServer(uvicorn.Server):
    """The server whose lifespan runs the application; it starts its
    companions once it has started and stops them before its own shutdown
    (and so before the lifespan's)."""

    def __init__(
        self, config: uvicorn.Config, companions: list[tuple[_Companion, socket.socket]]
    ) -> None:
        super().__init__(config)
        self.companions = companions
        self._tasks: list[asyncio.Task[None]] = []
        self.companion_failed = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        for companion, sock in self.companions:
            task = asyncio.create_task(companion.serve(sockets=[sock]), name="tls-listener")
            task.add_done_callback(self._companion_done)
            self._tasks.append(task)

    def _companion_done(self, task: asyncio.Task[None]) -> None:
        if self.should_exit:
            return
        # A listener that ends on its own failed: stop everything rather
        # than run without it.
        exc = None if task.cancelled() else task.exception()
        log.error("the TLS listener stopped: %s; stopping", exc or "cancelled")
        self.companion_failed = True
        self.should_exit = True

    def _pass_on(self) -> None:
        for companion, _ in self.companions:
            companion.should_exit = self.should_exit
            companion.force_exit = self.force_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._pass_on()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.should_exit = True
        self._pass_on()
        # Each companion closes its listener and drains its connections;
        # then this server does the same and runs the lifespan's shutdown.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().shutdown(sockets=sockets)


def _fail_on_settings(exc: SettingsValidationError) -> NoReturn:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    where = f"setting {field}: " if field else "settings: "
    sys.exit(f"error [invalid_input]: {where}{first['msg']}")


def run(
    *,
    host: str | None,
    port: int | None,
    provider: str | None,
    public_host: str | None = None,
    tls_mode: str | None = None,
    announce: bool = False,
) -> None:
    overrides: dict[str, Any] = {}
    if tls_mode is not None:
        overrides["tls"] = tls_mode
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if provider is not None:
        overrides["provider"] = provider
    if public_host is not None:
        overrides["public_host"] = public_host
    try:
        settings = Settings(**overrides)
    except SettingsValidationError as exc:
        _fail_on_settings(exc)
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
    app = create_app(settings, announce=announce, tune_gc=True)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=30,
    )
    try:
        tcp = config.bind_socket()
    except SystemExit:
        sys.exit(f"error [unavailable]: cannot listen on {settings.host}:{settings.port}")
    settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)
    companions: list[tuple[_Companion, socket.socket]] = []
    try:
        tls = server_tls(settings)
    except TlsSetupError as exc:
        tcp.close()
        sys.exit(f"error [invalid_input]: tls: {exc}")
    if tls is not None:
        listeners = [(settings.tls_port, "the API over TLS", "GPUCLUSTERS_TLS_PORT")]
        if settings.registry_enabled:
            listeners.append(
                (
                    settings.registry_token_port,
                    "the registry's token endpoint",
                    "GPUCLUSTERS_REGISTRY_TOKEN_PORT",
                )
            )
        for listen_port, what, env in listeners:
            tls_config = uvicorn.Config(
                app,
                host=settings.tls_host,
                port=listen_port,
                ssl_certfile=str(tls.cert_file),
                ssl_keyfile=str(tls.key_file),
                lifespan="off",
                log_level="info",
                timeout_graceful_shutdown=30,
            )
            try:
                tls_sock = tls_config.bind_socket()
            except SystemExit:
                tcp.close()
                for _, sock in companions:
                    sock.close()
                sys.exit(
                    f"error [unavailable]: cannot listen on {settings.tls_host}:{listen_port} "
                    f"({what}; set {env}, or GPUCLUSTERS_TLS=off)"
                )
            companions.append((_Companion(tls_config), tls_sock))
        ca_note = ""
        if tls.ca_file is not None:
            with contextlib.suppress(OSError, ValueError):
                ca_note = f"; CA {tls.ca_file}, SHA-256 {fingerprint(tls.ca_file.read_bytes())}"
        log.info("the API over TLS: %s%s", settings.tls_url, ca_note)
    server = _MainServer(config, companions)
    # `gpuclusters down` finds the servers of this home by these files
    # (replicas may share a home: one file each).
    pid_file = server_pid_file(settings.home, os.getpid())
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{settings.port}\n")
    try:
        server.run(sockets=[tcp, agent_socket(settings.home)])
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it caught once shutdown is complete;
        # a clean stop exits 0 (as `uvicorn.run` does).
        pass
    except FleetFileError as exc:
        sys.exit(f"error [invalid_input]: {exc}")
    finally:
        pid_file.unlink(missing_ok=True)
    if not server.started:
        sys.exit("error [unavailable]: the server did not start; see the log above")
    if server.companion_failed:
        sys.exit("error [unavailable]: the TLS listener failed; see the log above")
