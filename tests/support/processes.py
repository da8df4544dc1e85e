"""Starting the real ``gpuclusters`` programs from tests."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def console_script() -> list[str]:
    """The ``gpuclusters`` console script of this environment."""
    script = Path(sys.executable).parent / "gpuclusters"
    if script.exists():
        return [str(script)]
    found = shutil.which("gpuclusters")
    if found:
        return [found]
    return [sys.executable, "-c", "from gpuclusters.cli.main import main; main()"]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any GPUCLUSTERS_* setting of
    the developer's own, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLUSTERS_")}
    env.update(extra)
    return env
