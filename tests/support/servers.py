"""Real ``gpuclusters server`` subprocesses for end-to-end tests
(``tests/e2e/conftest.py`` makes fixtures of them): each server gets its own
``GPUCLUSTERS_HOME`` (database, ``config.toml`` with the bootstrap admin key,
and the fake provider's ``fake-provider.sqlite``, which outlives the process
like real VMs would) and a free port. A handle can be killed with SIGKILL,
stopped with SIGINT and restarted on the same home and port; ``Servers``
stops every server it started. Kept here, not in a conftest, so that test
modules import it by one name whichever conftest pytest loaded first.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuclusters.providers.fake.provider import read_instances, write_instances
from support.processes import clean_env, console_script, free_port

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def wait_for(
    what: str,
    check: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f"\n{describe()}" if describe else ""
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(interval)


class ServerHandle:
    """One server process on a fixed home and port (across restarts)."""

    def __init__(
        self,
        home: Path,
        log_path: Path,
        *,
        boot_delay_s: float,
        provider: str = "fake",
        public_host: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.provider = provider
        self.home = home
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = clean_env(
            GPUCLUSTERS_HOME=str(home),
            GPUCLUSTERS_FAKE_BOOT_DELAY_S=str(boot_delay_s),
            GPUCLUSTERS_RECONCILE_INTERVAL_S="0.5",
            GPUCLUSTERS_HOUSEKEEPING_INTERVAL_S="1",
            # Acceptance tests are off in tests (tests that want them say so).
            GPUCLUSTERS_ACCEPTANCE_CHECKS="[]",
            # The API over TLS only where a test asks for it (its port is shared).
            GPUCLUSTERS_TLS="off",
        )
        if public_host is not None:
            # Gateway ports on an address of the tests' own, never the
            # machine's primary address, from a range of this server's own:
            # gateway ports are the machine's, and two servers (a test's
            # and one a developer runs beside it) must not share one.
            self.env["GPUCLUSTERS_PUBLIC_HOST"] = public_host
            first = 20000 + random.randrange(100) * 100
            self.env["GPUCLUSTERS_GATEWAY_PORTS"] = f"{first}-{first + 99}"
        if provider in ("netns", "hosts"):
            # Nodes pull from the image registry, which needs the API over
            # TLS (its token endpoint); ports of this server's own. Only the
            # images every node needs are pushed at start unless a test
            # asks for more (GPUCLUSTERS_REGISTRY_SYSTEM_IMAGES).
            self.env.update(
                GPUCLUSTERS_TLS="on",
                GPUCLUSTERS_TLS_PORT=str(free_port()),
                GPUCLUSTERS_REGISTRY_PORT=str(free_port()),
                GPUCLUSTERS_REGISTRY_TOKEN_PORT=str(free_port()),
                GPUCLUSTERS_REGISTRY_SYSTEM_IMAGES='["base", "pause"]',
                # The metrics database (on where the binary is built) and its
                # rule engine on ports of this server's own, scraping every
                # 5 s so that charts fill within a test's patience.
                GPUCLUSTERS_METRICS_DB_PORT=str(free_port()),
                GPUCLUSTERS_METRICS_ALERT_PORT=str(free_port()),
                GPUCLUSTERS_METRICS_SCRAPE_INTERVAL_S="5",
            )
        self.env.update(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # -- process control -------------------------------------------------------

    # ``up``: start it as a user does (`gpuclusters up`, the embedded
    # fleet with its own defaults) instead of ``server --provider``.
    use_up: bool = False

    @property
    def command(self) -> list[str]:
        if self.use_up:
            return [*console_script(), "up", "--port", str(self.port)]
        return [*console_script(), "server", "--provider", self.provider, "--port", str(self.port)]

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start #{self.starts}: {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C on pytest does not reach it directly
            )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as http:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    pytest.fail(f"server exited with status {rc} during start:\n{self.log}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/healthz").status_code == 200:
                        return
                if time.monotonic() >= deadline:
                    self.kill9()
                    pytest.fail(
                        f"server did not answer /healthz within {STARTUP_TIMEOUT_S:g}s:\n{self.log}"
                    )
                time.sleep(0.1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL: no shutdown hooks run, exactly like a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGINT (Ctrl-C), wait up to ``timeout`` seconds, then SIGKILL.

        Returns the exit status (negative: killed by that signal)."""
        assert self.proc is not None, "server was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return int(self.proc.returncode)

    def restart(self) -> None:
        """Start again on the same home and port (after kill9 or stop)."""
        if self.running:
            self.stop()
        self.start()

    def wait_for(
        self,
        what: str,
        check: Callable[[], Any],
        *,
        timeout: float,
        interval: float = 0.1,
        describe: Callable[[], str] | None = None,
    ) -> Any:
        """``wait_for`` whose failure message ends with this server's log."""

        def details() -> str:
            head = f"{describe()}\n" if describe else ""
            # Polling GETs would fill the tail; the lines worth reading are the rest.
            lines = [ln for ln in self.log.splitlines() if '"GET /' not in ln]
            tail = "\n".join(lines)[-8000:]
            return f"{head}--- server log (tail, polling GETs left out) ---\n{tail}"

        return wait_for(what, check, timeout=timeout, interval=interval, describe=details)

    # -- what the server left behind ---------------------------------------------

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def config(self) -> dict[str, Any]:
        return tomllib.loads((self.home / "config.toml").read_text())

    @property
    def api_key(self) -> str:
        return str(self.config()["api_key"])

    @property
    def provider_file(self) -> Path:
        return self.home / "fake-provider.sqlite"

    def instances(self) -> dict[str, dict[str, Any]]:
        """The fake provider's instances by node id, as persisted on disk."""
        return read_instances(self.provider_file)

    def write_instances(self, instances: dict[str, dict[str, Any]]) -> None:
        assert not self.running, "edit the provider's state only while the server is down"
        write_instances(self.provider_file, instances)

    def cli(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real ``gpuclusters`` CLI against this server: it finds the
        URL and the admin key in ``$GPUCLUSTERS_HOME/config.toml``; ``env``
        adds (or overrides) variables such as GPUCLUSTERS_API_KEY; ``stdin``
        is piped in (none by default)."""
        full_env = clean_env(GPUCLUSTERS_HOME=str(self.home), COLUMNS="200", NO_COLOR="1")
        full_env.update(env or {})
        try:
            return subprocess.run(
                [*console_script(), *args],
                env=full_env,
                input=stdin if stdin is not None else "",
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"gpuclusters {' '.join(args)} ran over {timeout:g}s: {exc}")

    def client(self, api_key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key or self.api_key}"},
            timeout=10.0,
        )


class Servers:
    """Starts servers and guarantees they are all gone at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.handles: list[ServerHandle] = []

    def __call__(
        self,
        *,
        boot_delay_s: float = 0.2,
        start: bool = True,
        provider: str = "fake",
        public_host: str | None = None,
        home: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> ServerHandle:
        """A server on a home of its own, or on ``home`` (a replica beside
        another server there: docs/ha.md); ``env`` adds settings."""
        n = len(self.handles)
        home = home or self.root / f"home{n}"
        if public_host is None and provider in ("netns", "hosts"):
            public_host = gateway_for_tests()
        handle = ServerHandle(
            home,
            self.root / f"server{n}.log",
            boot_delay_s=boot_delay_s,
            provider=provider,
            public_host=public_host,
            extra_env=env,
        )
        self.handles.append(handle)
        if start:
            handle.start()
        return handle

    def close(self) -> None:
        for h in self.handles:
            if h.running:
                h.stop(timeout=10)
            if h.proc is not None and h.proc.poll() is None:  # pragma: no cover
                h.kill9()
            if h.provider in ("netns", "hosts"):
                cleanup_netns(h.home)
            stop_kept_daemons(h.home)


# The daemons a server keeps (server/kept_process.py): their pid files.
KEPT_PID_FILES = ("registry/registry.pid", "metrics/victoria-metrics.pid", "metrics/vmalert.pid")


def stop_kept_daemons(home: Path) -> None:
    """Safety net: the registry, metrics database and rule engine a server
    under ``home`` left running (a server killed with SIGKILL and not
    started again does not stop them; by design, its next start keeps
    them)."""
    for name in KEPT_PID_FILES:
        try:
            pid = int((home / name).read_text().strip())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if str(home) in argv:  # ours, not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


TEST_GATEWAY = "10.230.0.1"
TEST_GATEWAY_LINK = "lo"


def gateway_for_tests() -> str:
    """An address of this machine that only tests use (on the loopback
    link; idempotent): the public host of netns servers in tests, so
    gateway traffic never goes to the machine's real addresses."""
    have = subprocess.run(
        ["ip", "-br", "-4", "addr", "show", "dev", TEST_GATEWAY_LINK],
        capture_output=True,
        text=True,
    )
    if f"{TEST_GATEWAY}/32" not in have.stdout:
        subprocess.run(
            ["ip", "addr", "replace", f"{TEST_GATEWAY}/32", "dev", TEST_GATEWAY_LINK], check=True
        )
    return TEST_GATEWAY


def cleanup_netns(home: Path) -> None:
    """Safety net for tests on the netns provider: remove every node and
    service node the provider recorded under ``home``, whatever state the
    server was left in (namespaces outlive the server by design)."""
    import asyncio

    from gpuclusters.providers.registry import ProviderOptions, make_provider

    state_file = home / "netns-provider.json"
    if not state_file.exists():
        return
    data = json.loads(state_file.read_text())
    # Nodes on hosts with agents are those hosts' business (their harness
    # removes them); their records here only hold the cluster network up.
    nodes = {k: v for k, v in data.get("nodes", {}).items() if v.get("kind") != "remote"}
    if len(nodes) != len(data.get("nodes", {})):
        data["nodes"] = nodes
        state_file.write_text(json.dumps(data))

    async def run() -> None:
        provider = make_provider("netns", ProviderOptions(home=home))
        access: Any = provider
        for node_id, rec in nodes.items():
            if rec.get("kind") == "gpu":
                await provider.delete(node_id)
        for cluster_id in {rec.get("cluster_id") for rec in nodes.values()}:
            if cluster_id:
                await access.delete_service_nodes(cluster_id=cluster_id)
        await provider.close()

    asyncio.run(run())
