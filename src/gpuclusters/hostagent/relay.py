"""The node agents' way to the server from a host that is not the server.

On the server's machine a node's agent heartbeats to the server's unix
socket, bound into the node at ``/run/gpuclusters/control/agent.sock``. On a
host, the host agent listens on that socket (in its run directory, bound
into its nodes the same way) and relays each connection, byte for byte,
into a TLS connection to the server's HTTPS port, verified against the
server's CA. The node agent is unchanged, and its per-node token still
authenticates it: the relay adds encryption, not authority.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


class Relay:
    def __init__(self, socket_path: Path, server_url: str, ctx: ssl.SSLContext) -> None:
        parts = urlsplit(server_url)
        if parts.hostname is None:
            raise ValueError(f"no host in {server_url}")
        self._path = socket_path
        self._host = parts.hostname
        self._port = parts.port or 443
        self._ctx = ctx
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()  # a socket left by the previous run
        self._server = await asyncio.start_unix_server(self._handle, path=str(self._path))
        os.chmod(self._path, 0o666)  # node agents run as root, but be explicit

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self._host, self._port, ssl=self._ctx, server_hostname=self._host
                ),
                timeout=10,
            )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            log.warning("relay: cannot reach the server at %s:%s: %s", self._host, self._port, exc)
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
