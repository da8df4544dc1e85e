"""``gpuclusters login --sso`` as a user runs it: a real server process over
TLS with single sign-on through a real Dex, the real CLI on the user's
machine (its own home) printing the provider's page and a code, a person
(the test, with Dex's pages) signing in there, then commands with the
session, ``gpuclusters audit list`` showing them, and ``gpuclusters
logout`` ending the session."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.dex import DEX_BIN, Dex, DexUser, sign_in_device
from support.processes import clean_env, console_script, free_port
from test_cli_login import TlsServer, describe, gpuclusters, start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DEX_BIN.is_file(), reason="run scripts/build-k8s-addons dex first"),
]


@pytest.fixture(scope="module")
def dex(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dex]:
    d = Dex(
        tmp_path_factory.mktemp("dex"),
        host="127.0.0.1",
        port=free_port(),
        redirect_uris=[],
        users=[DexUser("carol", ["ml-team"])],
    )
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, dex: Dex) -> Iterator[TlsServer]:
    handle = start_server(
        tmp_path_factory.mktemp("sso-server"),
        extra_env={
            "GPUCLUSTERS_SSO_ISSUER": dex.issuer,
            "GPUCLUSTERS_SSO_CLIENT_SECRET": dex.client_secret,
            "GPUCLUSTERS_SSO_GROUP_ROLES": json.dumps(
                [{"group": "ml-team", "project": "default", "role": "editor"}]
            ),
        },
    )
    try:
        yield handle
    finally:
        handle.stop()


def test_login_with_sso_prints_a_code_and_stores_a_session(
    server: TlsServer, dex: Dex, tmp_path: Path
) -> None:
    home = tmp_path / "carol"
    cli = subprocess.Popen(
        [*console_script(), "login", "--sso", "--url", server.tls_url,
         "--ca-file", str(server.ca_file)],
        env=clean_env(GPUCLUSTERS_HOME=str(home), COLUMNS="200", NO_COLOR="1"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[str] = []

    def read_stderr() -> None:
        assert cli.stderr is not None
        for line in cli.stderr:
            seen.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    url = code = None
    while time.monotonic() < deadline and not (url and code):
        text = "".join(seen)
        if found := re.search(r"open (\S+)\s+and enter the code (\S+)", text):
            url, code = found[1], found[2]
        time.sleep(0.1)
    assert url and code, "".join(seen)
    # What the user does in their browser.
    sign_in_device(url, code, email="carol@example.com")
    cli.wait(timeout=60)
    reader.join(timeout=5)
    assert cli.stdout is not None
    out = cli.stdout.read()
    assert cli.returncode == 0, out + "".join(seen)
    assert "logged in to" in "".join(seen) and "as carol" in "".join(seen)
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["api_key"].startswith("gpc_") and "password" not in json.dumps(config)

    me = gpuclusters(home, "whoami", "--output", "json")
    assert me.returncode == 0, describe(me)
    assert json.loads(me.stdout)["projects"] == {"default": "editor"}
    # The operator sees the sign-in in the audit log.
    admin = server.home
    log = gpuclusters(admin, "audit", "list", "--user", "carol", "--output", "json",
                      GPUCLUSTERS_URL=server.url, GPUCLUSTERS_API_KEY=server.api_key)  # fmt: skip
    assert log.returncode == 0, describe(log)
    assert "poll_device" in [e["action"] for e in json.loads(log.stdout)]
    # Signing out ends the session at the server.
    key = config["api_key"]
    out_ = gpuclusters(home, "logout")
    assert out_.returncode == 0, describe(out_)
    again = gpuclusters(home, "whoami", GPUCLUSTERS_API_KEY=key)
    assert again.returncode != 0 and "unauthenticated" in again.stderr, describe(again)


def test_login_with_sso_on_a_server_without_it_is_a_clear_error(tmp_path: Path) -> None:
    plain = start_server(tmp_path / "plain")
    try:
        r = gpuclusters(tmp_path / "u", "login", "--sso", "--url", plain.url)
        assert r.returncode == 1 and "has no single sign-on" in r.stderr, describe(r)
        assert not (tmp_path / "u" / "config.toml").exists()
    finally:
        plain.stop()
