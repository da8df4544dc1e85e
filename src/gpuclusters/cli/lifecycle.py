"""``gpuclusters up --detach`` and ``gpuclusters down [--purge]``: the
server of this machine's ``$GPUCLUSTERS_HOME`` in the background, and
stopping it.

``up --detach`` starts ``gpuclusters up`` (same options) as a session of
its own, its output appended to ``$GPUCLUSTERS_HOME/server.log``, and
returns once the server answers ``/healthz`` (or says why it did not). A
server already running for this home is left alone: a second ``up
--detach`` changes nothing.

``down`` stops every server of the home (the files under ``servers/``,
core/serverpids.py; a pid reused by another program since is left alone)
with SIGINT, the server's graceful stop, then SIGKILL after ``--timeout``.
Nodes keep running, as for Ctrl-C. ``--purge`` first deletes every
cluster (and waits until they are gone: their namespaces, links,
iptables chains and cgroups with them) and every volume, through the
running server, then stops it and removes the host's base iptables chains
and puts ``ip_forward`` back as it was (``firewall.remove_base``; left
alone while another gpuclusters server runs on this machine, or another
server's clusters still have chains).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer

from gpuclusters.cli import builds
from gpuclusters.cli.context import open_client, stderr_console
from gpuclusters.core.clientconfig import default_home, read_config
from gpuclusters.core.errors import InvalidStateError
from gpuclusters.core.serverpids import servers_dir
from gpuclusters.linux import firewall
from gpuclusters.linux.procs import process_running

LOG_NAME = "server.log"
START_TIMEOUT_S = 300.0


def _is_server(pid: int) -> bool:
    """A live process that is a gpuclusters server (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"gpuclusters" in part for part in cmdline) and (
        b"up" in cmdline or b"server" in cmdline
    )


def running_servers(home: Path) -> list[int]:
    """The live servers of ``home``; stale files are removed."""
    found = []
    try:
        entries = list(servers_dir(home).iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        pid = int(entry.name) if entry.name.isdigit() else 0
        if pid and _is_server(pid):
            found.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return sorted(found)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def up_detached(*, port: int | None, public_host: str | None) -> None:
    """``gpuclusters up --detach``: start it unless a server of this home
    runs already."""
    home = default_home()
    url = server_url(home, port)
    running = running_servers(home)
    if running:
        typer.echo(f"gpuclusters already runs for {home} (pid {running[0]}): {url}")
        return
    argv = ["up"]
    if port is not None:
        argv += ["--port", str(port)]
    if public_host is not None:
        argv += ["--public-host", public_host]
    pid = start_detached(argv, home, url)
    typer.echo(
        f"gpuclusters is up (pid {pid}): {url}; log {home / LOG_NAME}; `gpuclusters down` stops it"
    )
    line = builds.current_line()
    if line is not None:
        # Clusters wait (waiting_for_build) for what they need of it.
        typer.echo(f"{line}; `gpuclusters builds` shows each step")


def start_detached(argv: list[str], home: Path, url: str) -> int:
    """Start ``gpuclusters <argv>`` in the background; its pid once it
    answers at ``url``."""
    err = stderr_console()
    log_path = home / LOG_NAME
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from gpuclusters.cli.main import main; main()", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    with err.status(f"starting the server (log: {log_path})"):
        while not _healthy(url):
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                err.print(f"the server exited with {proc.returncode}; its log ends:\n{tail}")
                raise typer.Exit(1)
            if time.monotonic() > deadline:
                err.print(f"the server did not answer at {url} in {START_TIMEOUT_S:.0f}s")
                raise typer.Exit(1)
            time.sleep(0.5)
    return proc.pid


def stop(pids: list[int], timeout_s: float) -> None:
    """SIGINT (graceful), then SIGKILL after ``timeout_s``; returns once each
    has exited."""
    pids = [p for p in pids if _is_server(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while any(process_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _is_server(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    while any(process_running(p) for p in pids):
        time.sleep(0.1)


def purge_through_server(timeout_s: float) -> tuple[int, int]:
    """Delete every cluster the admin sees, wait until they are gone, then
    every volume; returns (clusters, volumes) deleted."""
    err = stderr_console()
    clusters = volumes = 0
    with open_client(None) as client:
        projects = [p.name for p in client.projects.list()]
    for project in projects:
        with open_client(project) as client:
            names = [c.name for c in client.clusters.list()]
            for name in names:
                client.clusters.delete(name)
            for name in names:
                err.print(f"deleting cluster {project}/{name}")
                client.clusters.wait(name, until="deleted", timeout=timeout_s)
            clusters += len(names)
            for volume in client.volumes.list():
                err.print(f"deleting volume {project}/{volume.name}")
                client.volumes.delete(volume.name)
                volumes += 1
    return clusters, volumes


def down(purge: bool, timeout_s: float) -> None:
    err = stderr_console()
    home = default_home()
    pids = running_servers(home)
    if purge:
        if not pids:
            raise InvalidStateError(
                f"no server runs for {home}: --purge deletes clusters through it "
                "(gpuclusters up --detach, then gpuclusters down --purge)"
            )
        clusters, volumes = purge_through_server(timeout_s)
        err.print(f"deleted {clusters} cluster(s) and {volumes} volume(s)")
    if not pids:
        err.print(f"no server runs for {home}")
    else:
        err.print(f"stopping the server ({', '.join(map(str, pids))})")
        stop(pids, timeout_s=min(timeout_s, 60.0))
    if purge:
        others = other_servers()
        if others:
            err.print(
                "kept the host's iptables chains: other gpuclusters servers run here "
                f"({', '.join(map(str, others))})"
            )
        elif asyncio.run(firewall.remove_base()):
            err.print("removed the host's iptables chains; ip_forward is as it was")
        else:
            err.print("kept the host's iptables chains: another server's clusters use them")


def other_servers() -> list[int]:
    """Live gpuclusters servers on this machine, of any home (their nodes'
    access to the registry rests on the base chains too)."""
    pids = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
    return sorted(p for p in pids if process_running(p) and _is_server(p))


def server_url(home: Path, port: int | None) -> str:
    if port is not None:
        return f"http://127.0.0.1:{port}"
    stored = read_config(home).url
    return stored if stored and stored.startswith("http://") else "http://127.0.0.1:8470"
