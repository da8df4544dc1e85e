"""The API over TLS, end to end: a real ``gpuclusters server --provider fake
--public-host gw.test`` process and the real CLI logging in to it.

Nothing leaves this machine: both listeners are bound to 127.0.0.1 (the TLS
one through ``GPUCLUSTERS_TLS_HOST``), ``gw.test`` is only a name in the
certificate, and the CLI reaches the server as ``127.0.0.1`` and
``localhost``, which the server certificate names too. Every CLI run gets
its own ``GPUCLUSTERS_HOME``, the user's machine, distinct from the
server's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import tomllib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gpuclusters.cli.main import app
from gpuclusters.layers.kubernetes import pki
from support.processes import clean_env, console_script, free_port

START_TIMEOUT_S = 30.0


def refuses(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class TlsServer:
    proc: subprocess.Popen[bytes]
    home: Path
    log_path: Path
    port: int
    tls_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}"

    @property
    def ca_file(self) -> Path:
        return self.home / "tls" / "ca.pem"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def api_key(self) -> str:
        return str(tomllib.loads((self.home / "config.toml").read_text())["api_key"])

    def logged_fingerprint(self) -> str:
        """The CA fingerprint the server printed at start."""
        found = re.search(r"SHA-256 ((?:[0-9A-F]{2}:){31}[0-9A-F]{2})", self.log)
        assert found, self.log
        return found.group(1)

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return int(self.proc.returncode)


def start_server(
    root: Path,
    *,
    tls_port: int | None = None,
    wait: bool = True,
    extra_env: dict[str, str] | None = None,
) -> TlsServer:
    root.mkdir(parents=True, exist_ok=True)
    server = TlsServer(
        proc=None,  # type: ignore[arg-type]  # set just below
        home=root / "server-home",
        log_path=root / "server.log",
        port=free_port(),
        tls_port=tls_port or free_port(),
    )
    env = clean_env(
        GPUCLUSTERS_HOME=str(server.home),
        GPUCLUSTERS_TLS_HOST="127.0.0.1",
        GPUCLUSTERS_TLS_PORT=str(server.tls_port),
        GPUCLUSTERS_FAKE_BOOT_DELAY_S="0.05",
        GPUCLUSTERS_ACCEPTANCE_CHECKS="[]",
        **(extra_env or {}),
    )
    command = [*console_script(), "server", "--provider", "fake", "--port", str(server.port)]
    with server.log_path.open("wb") as log:
        server.proc = subprocess.Popen(
            [*command, "--public-host", "gw.test"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: TlsServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}:\n{server.log}")
        with contextlib.suppress(httpx.HTTPError, OSError, ssl.SSLError):
            ctx = ssl.create_default_context(cafile=str(server.ca_file))
            with httpx.Client(timeout=2.0, verify=ctx) as http:
                if (
                    http.get(f"{server.url}/healthz").status_code == 200
                    and http.get(f"{server.tls_url}/healthz").status_code == 200
                ):
                    return
        if time.monotonic() >= deadline:
            server.stop(signal.SIGKILL)
            pytest.fail(f"server did not answer on both listeners:\n{server.log}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    handle = start_server(tmp_path_factory.mktemp("tls-server"))
    try:
        yield handle
    finally:
        handle.stop()


def gpuclusters(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real CLI on a user's machine whose home is ``home``."""
    return subprocess.run(
        [*console_script(), *args],
        env=clean_env(GPUCLUSTERS_HOME=str(home), COLUMNS="200", NO_COLOR="1", **env),
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def describe(r: subprocess.CompletedProcess[str]) -> str:
    return f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def refused(r: subprocess.CompletedProcess[str], code: str) -> str:
    assert r.returncode == 1, describe(r)
    assert r.stdout == "", describe(r)
    assert f"error [{code}]:" in r.stderr, describe(r)
    assert "Traceback" not in r.stderr, describe(r)
    return r.stderr


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# --- logging in --------------------------------------------------------------------------------


@pytest.mark.slow
def test_login_by_ca_fingerprint_then_commands_run_over_tls(
    server: TlsServer, tmp_path: Path
) -> None:
    home = tmp_path / "me"
    fp = server.logged_fingerprint()

    r = gpuclusters(
        home, "login", "--url", server.tls_url, "--api-key", server.api_key, "--ca-fingerprint", fp
    )

    assert r.returncode == 0, describe(r)
    assert "admin" in r.stdout and server.tls_url in r.stdout
    assert f"logged in to {server.tls_url} as admin (project default)" in r.stderr
    config = tomllib.loads((home / "config.toml").read_text())
    assert config == {
        "url": server.tls_url,
        "api_key": server.api_key,
        "project": "default",
        "ca_file": str((home / "ca.pem").resolve()),
    }
    assert stat.S_IMODE((home / "config.toml").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "ca.pem").stat().st_mode) == 0o644
    assert (home / "ca.pem").read_bytes() == server.ca_file.read_bytes()

    listed = gpuclusters(home, "clusters", "list", "--output", "json")
    assert listed.returncode == 0, describe(listed)
    assert json.loads(listed.stdout) == []
    me = gpuclusters(home, "whoami", "--output", "json")
    assert me.returncode == 0, describe(me)
    assert json.loads(me.stdout)["user"] == "admin"
    # The CLI pages through the list (client/_session.get_all).
    assert '"GET /v1/projects/default/clusters?limit=1000 HTTP/1.1" 200' in server.log

    # Another CA in GPUCLUSTERS_CA_FILE overrides the stored one, and fails.
    other = tmp_path / "other-ca.pem"
    other.write_bytes(pki.new_ca("someone else").cert)
    r = gpuclusters(home, "clusters", "list", GPUCLUSTERS_CA_FILE=str(other))
    assert "--ca-fingerprint" in refused(r, "untrusted_server")


@pytest.mark.slow
def test_login_by_ca_file_with_json_output(server: TlsServer, tmp_path: Path) -> None:
    home = tmp_path / "me"
    url = f"https://localhost:{server.tls_port}"  # the certificate's DNS name for this host

    r = gpuclusters(
        home,
        "login",
        "--url",
        url + "/",
        "--api-key",
        server.api_key,
        "--ca-file",
        str(server.ca_file),
        "--project",
        "default",
        "--output",
        "json",
    )

    assert r.returncode == 0, describe(r)
    assert json.loads(r.stdout) == {
        "user": "admin",
        "organization": "default",
        "is_admin": True,
        "projects": {"default": "admin"},
    }
    assert tomllib.loads((home / "config.toml").read_text())["url"] == url
    assert (home / "ca.pem").read_bytes() == server.ca_file.read_bytes()
    listed = gpuclusters(home, "clusters", "list")
    assert listed.returncode == 0, describe(listed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("wrong fingerprint", "untrusted_server", "not the server whose fingerprint"),
        ("no CA", "untrusted_server", "does not trust"),
        ("another CA file", "untrusted_server", "does not trust"),
        ("wrong key", "unauthenticated", "API key"),
        ("not a member", "not_found", "project 'nope'"),
        ("both CA options", "invalid_input", "not both"),
        ("plain http with a CA", "invalid_input", "https://"),
        ("malformed fingerprint", "invalid_input", "32 hex pairs"),
        ("nothing listening", "connection_failed", "could not reach"),
    ],
)
def test_a_failed_login_says_why_and_writes_nothing(
    server: TlsServer, tmp_path: Path, case: str, code: str, says: str
) -> None:
    home = tmp_path / "me"
    fp = server.logged_fingerprint()
    other = tmp_path / "other-ca.pem"
    other.write_bytes(pki.new_ca("someone else").cert)
    wrong_fp = ("00" if not fp.startswith("00") else "11") + fp[2:]
    args = {
        "wrong fingerprint": ["--ca-fingerprint", wrong_fp],
        "no CA": [],
        "another CA file": ["--ca-file", str(other)],
        "wrong key": ["--ca-file", str(server.ca_file)],
        "not a member": ["--ca-file", str(server.ca_file), "--project", "nope"],
        "both CA options": ["--ca-file", str(server.ca_file), "--ca-fingerprint", fp],
        "plain http with a CA": ["--ca-file", str(server.ca_file)],
        "malformed fingerprint": ["--ca-fingerprint", "AB:CD"],
        "nothing listening": ["--ca-fingerprint", fp],
    }[case]
    url = {
        "plain http with a CA": server.url,
        "nothing listening": f"https://127.0.0.1:{free_port()}",
    }.get(case, server.tls_url)
    key = "gpc_not-a-real-key" if case == "wrong key" else server.api_key

    r = gpuclusters(home, "login", "--url", url, "--api-key", key, *args)

    assert says in refused(r, code)
    assert files_under(home) == []


@pytest.mark.slow
def test_a_failed_login_keeps_the_previous_configuration(server: TlsServer, tmp_path: Path) -> None:
    home = tmp_path / "me"
    ok = gpuclusters(
        home, "login", "--url", server.tls_url, "--api-key", server.api_key,
        "--ca-file", str(server.ca_file),
    )  # fmt: skip
    assert ok.returncode == 0, describe(ok)
    before = {name: (home / name).read_bytes() for name in files_under(home)}

    r = gpuclusters(
        home, "login", "--url", server.tls_url, "--api-key", server.api_key,
        "--ca-fingerprint", "00" * 32,
    )  # fmt: skip

    refused(r, "untrusted_server")
    assert {name: (home / name).read_bytes() for name in files_under(home)} == before


@pytest.mark.slow
def test_the_ca_is_served_without_a_key_on_both_listeners(server: TlsServer) -> None:
    pem = server.ca_file.read_text()
    ctx = ssl.create_default_context(cafile=str(server.ca_file))
    with httpx.Client(timeout=5, verify=ctx) as http:
        for base in (server.url, server.tls_url):
            r = http.get(f"{base}/v1/tls/ca.pem")
            assert (r.status_code, r.text) == (200, pem)
            assert r.headers["content-type"].startswith("text/plain")
            assert http.get(f"{base}/v1/whoami").status_code == 401


# --- the server's lifecycle ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_both_listeners(tmp_path: Path, sig: int) -> None:
    handle = start_server(tmp_path)
    try:
        rc = handle.stop(sig)
    finally:
        handle.stop(signal.SIGKILL)

    # Ctrl-C is a clean exit; SIGTERM ends the process by that signal once
    # uvicorn has shut down (as before the TLS listener existed).
    assert rc in ((0,) if sig == signal.SIGINT else (0, -signal.SIGTERM)), handle.log
    assert "Application shutdown complete" in handle.log
    assert "Traceback" not in handle.log
    assert refuses(handle.port) and refuses(handle.tls_port)


@pytest.mark.slow
def test_a_busy_tls_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        handle = start_server(tmp_path, tls_port=busy.getsockname()[1], wait=False)
        try:
            handle.proc.wait(timeout=30)
        finally:
            handle.stop(signal.SIGKILL)
    assert handle.proc.returncode == 1, handle.log
    assert "error [unavailable]: cannot listen on 127.0.0.1:" in handle.log
    assert f"cannot listen on 127.0.0.1:{handle.tls_port} (the API over TLS;" in handle.log
    assert refuses(handle.port)


# --- wiring of --public-host -------------------------------------------------------------------


@pytest.fixture
def fake_server_module(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("gpuclusters.server.main")
    fake.run = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gpuclusters.server.main", fake)
    for var in (
        "GPUCLUSTERS_PUBLIC_HOST",
        "GPUCLUSTERS_HOST",
        "GPUCLUSTERS_PORT",
        "GPUCLUSTERS_PROVIDER",
    ):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_server_and_up_pass_public_host_on(
    fake_server_module: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["server", "--public-host", "gw.test"])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    r = runner.invoke(app, ["up"], env={"GPUCLUSTERS_PUBLIC_HOST": "10.229.0.1"})
    assert r.exit_code == 0, r.output

    assert fake_server_module == [
        {"host": None, "port": None, "provider": None, "public_host": "gw.test"},
        {
            "host": None,
            "port": None,
            "provider": "netns",
            "public_host": "10.229.0.1",
            "tls_mode": "on",  # up serves TLS (the registry needs it)
            "announce": True,
        },
    ]


def test_server_without_public_host_leaves_it_to_the_settings(
    fake_server_module: list[dict[str, Any]],
) -> None:
    r = CliRunner().invoke(app, ["server"])
    assert r.exit_code == 0, r.output
    assert fake_server_module == [{"host": None, "port": None, "provider": None}]
