"""A real ``gpuclusters server --provider netns`` for benchmarks: fresh home
under /tmp, the admin's API client, and a clean stop (SIGINT, then the home
is removed)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx


def wait(what: str, check: Any, timeout: float = 300, poll: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BENCH_GATEWAY = "10.230.0.1"


def bench_gateway() -> tuple[str, bool]:
    """The benches' public host, a /32 on lo, and whether this call added
    it (then the server's close removes it again)."""
    have = subprocess.run(["ip", "-br", "-4", "addr", "show", "dev", "lo"],
                          capture_output=True, text=True)  # fmt: skip
    if f"{BENCH_GATEWAY}/32" in have.stdout:
        return BENCH_GATEWAY, False
    subprocess.run(["ip", "addr", "replace", f"{BENCH_GATEWAY}/32", "dev", "lo"], check=True)
    return BENCH_GATEWAY, True


class BenchServer:
    def __init__(
        self,
        prefix: str,
        *,
        fleet: str | None = None,
        settings: dict[str, str] | None = None,
        provider: str = "netns",
    ) -> None:
        self.home = Path(tempfile.mkdtemp(prefix=prefix))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLUSTERS_")}
        env["GPUCLUSTERS_HOME"] = str(self.home)
        # Gateway ports on an address of the benches' own (on lo), never the
        # machine's real addresses; no TLS listener (its port is shared).
        env["GPUCLUSTERS_PUBLIC_HOST"], self._added_gateway = bench_gateway()
        env["GPUCLUSTERS_TLS"] = "off"
        env.update(settings or {})
        if fleet is not None:
            (self.home / "fleet.yaml").write_text(fleet)
            env["GPUCLUSTERS_FLEET_FILE"] = str(self.home / "fleet.yaml")
        self.env = env
        self.exe = Path(sys.executable).parent / "gpuclusters"
        port = free_port()
        self.proc = subprocess.Popen(
            [str(self.exe), "server", "--provider", provider, "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(self.home / "server.log").open("wb"),
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        wait("the server", healthy, timeout=60)
        key = tomllib.loads((self.home / "config.toml").read_text())["api_key"]
        self.api = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )

    def get(self, path: str) -> Any:
        r = self.api.get(path)
        r.raise_for_status()
        return r.json()

    def cli(self, *args: str, timeout: float = 60) -> str:
        """The real CLI against this server (e.g. ``clusters ssh``)."""
        out = subprocess.run(
            [str(self.exe), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout,
        )
        return out.stdout

    def close(self, cluster_path: str | None = None) -> None:
        """Delete ``cluster_path`` (with its volume), then stop the server."""
        try:
            if cluster_path is not None:
                self.api.delete(cluster_path, params={"delete_volume": True})
                wait(
                    "the delete",
                    lambda: self.api.get(cluster_path).status_code == 404,
                    timeout=300,
                    poll=0.5,
                )
        finally:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.home, ignore_errors=True)
            if self._added_gateway:
                subprocess.run(["ip", "addr", "del", f"{BENCH_GATEWAY}/32", "dev", "lo"],
                               check=False, capture_output=True)  # fmt: skip
