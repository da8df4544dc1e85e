"""Where a running server says it runs: ``$GPUCLUSTERS_HOME/servers/<pid>``
(its plain port inside), one file per server process, written once it
listens and removed when it exits; replicas sharing a home have one each.
``gpuclusters down`` stops the servers it finds there. Not under ``run/``,
which nodes see (their agent's socket). Paths only: no I/O."""

from __future__ import annotations

from pathlib import Path

SERVERS_DIR = Path("servers")


def servers_dir(home: Path) -> Path:
    return home / SERVERS_DIR


def server_pid_file(home: Path, pid: int) -> Path:
    return servers_dir(home) / str(pid)
