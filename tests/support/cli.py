"""The CLI in-process against a canned API (``FakeApi``): what every CLI
test module sets up the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from gpuclusters.cli import context
from gpuclusters.cli.main import app
from gpuclusters.client import Client
from support.fake_api import FakeApi


def ok(body: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


def isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A home of the test's own and none of the developer's settings."""
    monkeypatch.setenv("GPUCLUSTERS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    for var in (
        "GPUCLUSTERS_URL",
        "GPUCLUSTERS_API_KEY",
        "GPUCLUSTERS_PROJECT",
        "GPUCLUSTERS_OUTPUT",
    ):
        monkeypatch.delenv(var, raising=False)


def install_fake_api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    """Every client the CLI opens talks to the returned ``FakeApi``."""
    fake = FakeApi()

    def factory(project: str | None) -> Client:
        return Client(
            "http://api.test", "gpc_k", project or "default", transport=httpx.MockTransport(fake)
        )

    monkeypatch.setattr(context, "client_factory", factory)
    return fake


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=stdin)
