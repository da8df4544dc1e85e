"""scripts/go-env: which Go the Kubernetes builds use, for each Go a stock
machine may have (a fake ``go`` on PATH answers ``go env GOVERSION``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

GO_ENV = Path(__file__).resolve().parents[2] / "scripts" / "go-env"


def go_env(tmp_path: Path, version: str | None) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if version is not None:
        go = bin_dir / "go"
        go.write_text(f'#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && echo {version}\n')
        go.chmod(0o755)
    return subprocess.run(
        ["/bin/bash", "-c", f'. {GO_ENV}; go_env && echo "GOTOOLCHAIN=$GOTOOLCHAIN"'],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"} if version else {"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize(
    ("version", "toolchain"),
    [
        ("go1.26.8", "local"),
        ("go1.24.0", "local"),
        ("go1.23.4", "go1.27.3"),
        ("go1.21.0", "go1.27.3"),
    ],
)
def test_a_go_that_can_builds_or_fetches_one(tmp_path: Path, version: str, toolchain: str) -> None:
    r = go_env(tmp_path, version)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"GOTOOLCHAIN={toolchain}"


def test_debians_go_119_stops_with_what_to_install(tmp_path: Path) -> None:
    r = go_env(tmp_path, "go1.19.8")
    assert r.returncode != 0 and r.stdout == ""
    assert "Go 1.19.8" in r.stderr and "bookworm-backports" in r.stderr


def test_no_go_at_all(tmp_path: Path) -> None:
    r = go_env(tmp_path, None)
    assert r.returncode != 0 and "go is not installed" in r.stderr
