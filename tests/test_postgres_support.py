"""Checks for the throwaway PostgreSQL server used by the test suite (tests/support)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

try:
    from tests.support import postgres as pg
except ModuleNotFoundError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from support import postgres as pg  # type: ignore[no-redef]

pytestmark = pytest.mark.postgres


def _alive(pid: int) -> bool:
    return pg._pid_alive(pid)


def _processes_mentioning(path: Path) -> list[int]:
    """Pids of processes whose command line mentions `path` (e.g. ``postgres -D path/data``)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _kill_leftovers(pid: int | None, tmpdir: Path | None) -> None:
    """Last-resort cleanup so a failing test leaks nothing."""
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)
    if tmpdir is not None:
        for p in _processes_mentioning(tmpdir):
            os.kill(p, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[pg.PostgresServer]:
    yield from pg.postgres_server_fixture()


def test_binaries_found() -> None:
    assert pg.postgres_available(), "PostgreSQL binaries missing: run scripts/setup"
    bindir = pg.find_postgres_bindir()
    assert bindir is not None and (bindir / "initdb").exists()


async def test_asyncpg_select_1(server: pg.PostgresServer) -> None:
    conn = await asyncpg.connect(server.dsn)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("show fsync") == "off"
        assert await conn.fetchval("select current_database()") == server.database
    finally:
        await conn.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_sqlalchemy_async_engine(server: pg.PostgresServer, transport: str) -> None:
    url = server.url if transport == "tcp" else server.socket_url_for(server.database)
    assert url.startswith("postgresql+asyncpg://")
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("select 1"))).scalar_one() == 1
            if transport == "unix":
                # a unix-socket connection has no client address
                addr = (await conn.execute(text("select inet_client_addr()"))).scalar_one()
                assert addr is None
    finally:
        await engine.dispose()


async def test_create_and_temporary_databases(server: pg.PostgresServer) -> None:
    url = server.create_database("created_db")
    assert url == server.url_for("created_db")
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("create table t (x int)"))
            await conn.execute(text("insert into t values (42)"))
            assert (await conn.execute(text("select x from t"))).scalar_one() == 42
    finally:
        await engine.dispose()

    with server.temporary_database() as temp_url:
        name = temp_url.rsplit("/", 1)[1]
        conn = await asyncpg.connect(server.dsn_for(name))
        try:
            assert await conn.fetchval("select current_database()") == name
        finally:
            await conn.close()

    conn = await asyncpg.connect(server.dsn)
    try:
        names = {r["datname"] for r in await conn.fetch("select datname from pg_database")}
    finally:
        await conn.close()
    assert "created_db" in names
    assert name not in names  # dropped on exit
    server.drop_database("created_db")


def test_invalid_database_name(server: pg.PostgresServer) -> None:
    with pytest.raises(ValueError):
        server.create_database("bad-name; drop")


def test_stop_leaves_no_process() -> None:
    srv = pg.PostgresServer(database="lifecycle", start=False)
    pid: int | None = None
    tmpdir: Path | None = None
    try:
        with srv:
            pid, tmpdir = srv.pid, srv.tmpdir
            assert pid is not None and tmpdir is not None
            assert _alive(pid)
            assert srv.socket_dir.joinpath(f".s.PGSQL.{srv.port}").exists()
        assert not _alive(pid)
        assert not tmpdir.exists()
        assert _processes_mentioning(tmpdir) == []
        srv.stop()  # idempotent
    finally:
        _kill_leftovers(pid, tmpdir)


def test_watchdog_stops_server_when_test_process_is_killed() -> None:
    tests_dir = Path(pg.__file__).resolve().parents[1]
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(tests_dir)!r})
        from support.postgres import PostgresServer
        srv = PostgresServer()
        print(srv.pid, srv.tmpdir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    pid: int | None = None
    tmpdir: Path | None = None
    try:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        pid_s, tmp_s = proc.stdout.split()
        pid, tmpdir = int(pid_s), Path(tmp_s)
        assert _wait_gone(pid), "postmaster outlived the killed test process"
        deadline = time.monotonic() + 10
        while tmpdir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tmpdir.exists()
    finally:
        _kill_leftovers(pid, tmpdir)


def test_missing_binaries_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUCLUSTERS_PG_BINDIR", str(tmp_path / "nowhere"))
    assert not pg.postgres_available()
    with pytest.raises(pg.PostgresUnavailable, match="scripts/setup"):
        pg.PostgresServer()
