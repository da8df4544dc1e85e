"""Where the background builder keeps its state, and reading it.

``$GPUCLUSTERS_BUILDS_DIR`` (default ``/var/cache/gpuclusters/builds``,
beside the caches it fills): ``status.json`` (core/builds.py's document,
replaced atomically at every change), ``runner.lock`` (held by the one
running builder, ``flock``), ``runner.log`` and ``logs/<step>.log``.
Readers need no lock: a reader sees one whole document or none.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpuclusters.core.builds import BuildStatus
from gpuclusters.linux.procs import process_running

DIR_ENV = "GPUCLUSTERS_BUILDS_DIR"
DEFAULT_DIR = Path("/var/cache/gpuclusters/builds")


def builds_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


def status_path(directory: Path | None = None) -> Path:
    return (directory or builds_dir()) / "status.json"


@dataclass(frozen=True, slots=True)
class Observed:
    status: BuildStatus
    alive: bool  # its builder still runs


def read(directory: Path | None = None) -> Observed | None:
    """The builder's last status, or None when no builder ever wrote one
    (or the file is unreadable: nothing to wait for)."""
    try:
        doc = json.loads(status_path(directory).read_text())
        status = BuildStatus.from_json(doc)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    alive = status.finished_at is None and process_running(status.runner_pid)
    return Observed(status, alive)


def write(status: BuildStatus, directory: Path) -> None:
    path = status_path(directory)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status.as_json(), indent=1) + "\n")
    os.chmod(tmp, 0o644)
    tmp.replace(path)
