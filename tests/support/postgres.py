"""Throwaway PostgreSQL servers for tests.

`PostgresServer` runs ``initdb`` into a fresh temporary directory and starts a private
``postgres`` on 127.0.0.1 (free port) plus a unix socket inside that directory, with
``fsync=off`` and trust authentication for the superuser ``postgres``.  It never touches the
system cluster.  As root it runs the server as the ``postgres`` system user (or creates the
system user ``gpuclusters-pg``), because PostgreSQL refuses to run as root.

A watchdog process stops the server and removes its directory if the test process dies
without calling `PostgresServer.stop` (even on SIGKILL), so no server outlives its tests.

Use from ``tests/conftest.py``::

    import pytest
    from support.postgres import PostgresServer, postgres_server_fixture

    @pytest.fixture(scope="session")
    def postgres_server() -> Iterator[PostgresServer]:
        yield from postgres_server_fixture()

    @pytest.fixture
    def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
        # a fresh, empty database per test, dropped afterwards
        with postgres_server.temporary_database() as url:
            yield url          # "postgresql+asyncpg://postgres@127.0.0.1:PORT/test_..."

Tests that need PostgreSQL should carry ``@pytest.mark.postgres`` so that
``pytest -m "not postgres"`` runs without it.  Binaries come from ``pg_config --bindir``,
else the newest ``/usr/lib/postgresql/*/bin`` (override with ``GPUCLUSTERS_PG_BINDIR``);
``scripts/setup`` installs them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

__all__ = [
    "PostgresServer",
    "PostgresUnavailable",
    "find_postgres_bindir",
    "postgres_available",
    "postgres_server_fixture",
]

SUPERUSER = "postgres"
DEFAULT_DATABASE = "gpuclusters"
_RUN_AS_CANDIDATES = ("postgres", "gpuclusters-pg")
_DB_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SETUP_HINT = "run scripts/setup (it installs PostgreSQL with apt-get)"


class PostgresUnavailable(RuntimeError):
    """PostgreSQL binaries are missing or the server could not be started."""


def find_postgres_bindir() -> Path | None:
    """Directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""

    def ok(d: str | Path) -> bool:
        return all(os.access(Path(d) / b, os.X_OK) for b in ("initdb", "pg_ctl", "postgres"))

    override = os.environ.get("GPUCLUSTERS_PG_BINDIR")
    if override:
        return Path(override) if ok(override) else None
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and ok(out):
                return Path(out)

    def version(d: str) -> tuple[int, ...]:
        v = Path(d).parent.name
        return tuple(int(p) for p in v.split(".")) if re.fullmatch(r"\d+(\.\d+)*", v) else (0,)

    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    for d in debian:
        if ok(d):
            return Path(d)
    initdb = shutil.which("initdb")
    if initdb and ok(Path(initdb).parent):
        return Path(initdb).parent
    return None


def postgres_available() -> bool:
    """True when a throwaway server can be started (binaries present; as root: runuser)."""
    if find_postgres_bindir() is None:
        return False
    return os.geteuid() != 0 or shutil.which("runuser") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _run_as_user() -> str | None:
    """System user to run the server as, when we are root (created if needed)."""
    if os.geteuid() != 0:
        return None
    import pwd

    for name in _RUN_AS_CANDIDATES:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    name = _RUN_AS_CANDIDATES[-1]
    nologin = "/usr/sbin/nologin" if os.path.exists("/usr/sbin/nologin") else "/bin/false"
    proc = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", nologin, name],
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 9):  # 9: already exists (created concurrently)
        raise PostgresUnavailable(f"cannot create system user {name}: {proc.stderr.strip()}")
    return name


# Runs in a separate session; blocks until the test process closes the pipe (normally by
# dying), then stops the server and removes its directory.  `stop()` kills it first.
_WATCHDOG = r"""
import os, shutil, signal, subprocess, sys, time
sys.stdin.buffer.read()
pg_ctl, datadir, tmpdir, user = sys.argv[1:5]
cmd = [pg_ctl, "stop", "-D", datadir, "-m", "immediate", "-w", "-t", "10"]
if user:
    cmd = ["runuser", "-u", user, "--"] + cmd
try:
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
except Exception:
    pass
try:
    with open(os.path.join(datadir, "postmaster.pid")) as f:
        os.kill(int(f.readline()), signal.SIGKILL)
except Exception:
    pass
time.sleep(0.5)
shutil.rmtree(tmpdir, ignore_errors=True)
"""


class PostgresServer:
    """A private PostgreSQL server in a temporary directory. Use as a context manager."""

    def __init__(self, *, database: str = DEFAULT_DATABASE, start: bool = True) -> None:
        self.database = database
        self.bindir: Path | None = None
        self.tmpdir: Path | None = None
        self.port: int = 0
        self.pid: int | None = None
        self._user: str | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    # -- paths and URLs --------------------------------------------------------------------

    @property
    def datadir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir

    @property
    def logfile(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "postgres.log"

    def url_for(self, database: str) -> str:
        """SQLAlchemy async URL (asyncpg driver) for a database on this server, over TCP."""
        return f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def socket_url_for(self, database: str) -> str:
        """Same as `url_for`, but over the unix socket."""
        return (
            f"postgresql+asyncpg://{SUPERUSER}@/{database}?host={self.socket_dir}&port={self.port}"
        )

    def dsn_for(self, database: str) -> str:
        """Plain libpq-style DSN, e.g. for ``asyncpg.connect``."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        """SQLAlchemy async URL of the default database."""
        return self.url_for(self.database)

    @property
    def dsn(self) -> str:
        return self.dsn_for(self.database)

    # -- lifecycle -------------------------------------------------------------------------

    def _cmd(self, *args: str | Path) -> list[str]:
        cmd = [str(a) for a in args]
        return ["runuser", "-u", self._user, "--", *cmd] if self._user else cmd

    def _run(self, *args: str | Path, timeout: float = 60) -> None:
        proc = subprocess.run(
            self._cmd(*args), capture_output=True, text=True, timeout=timeout, cwd="/"
        )
        if proc.returncode != 0:
            log = ""
            with contextlib.suppress(OSError, AssertionError):
                log = self.logfile.read_text()[-4000:]
            raise PostgresUnavailable(
                f"{' '.join(str(a) for a in args)} failed (exit {proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}{log}"
            )

    def start(self) -> None:
        if self.pid is not None:
            return
        bindir = find_postgres_bindir()
        if bindir is None:
            raise PostgresUnavailable(f"PostgreSQL server binaries not found; {_SETUP_HINT}")
        if os.geteuid() == 0 and shutil.which("runuser") is None:
            raise PostgresUnavailable(f"running as root needs runuser (util-linux); {_SETUP_HINT}")
        self.bindir = bindir
        self._user = _run_as_user()
        # As root the server user must reach the directory: use /tmp, not a private TMPDIR.
        base = "/tmp" if self._user else None
        self.tmpdir = Path(tempfile.mkdtemp(prefix="gpuclusters-pg-", dir=base))
        try:
            if self._user:
                shutil.chown(self.tmpdir, user=self._user, group=None)
            self._initdb()
            self._start_watchdog()
            self._start_postgres()
            self.create_database(self.database)
        except BaseException:
            self.stop()
            raise

    def _initdb(self) -> None:
        assert self.bindir is not None
        self._run(
            self.bindir / "initdb",
            "-D",
            self.datadir,
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "64MB",
            "log_min_messages": "warning",
            "log_min_error_statement": "error",
            "timezone": "'UTC'",
        }
        with (self.datadir / "postgresql.conf").open("a") as f:
            f.write("\n# gpuclusters test server\n")
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())

    def _start_watchdog(self) -> None:
        assert self.bindir is not None and self.tmpdir is not None
        self._watchdog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WATCHDOG,
                str(self.bindir / "pg_ctl"),
                str(self.datadir),
                str(self.tmpdir),
                self._user or "",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal must not reach it
            cwd="/",
        )

    def _start_postgres(self) -> None:
        assert self.bindir is not None
        for attempt in range(5):
            self.port = _free_port()
            try:
                self._run(
                    self.bindir / "pg_ctl",
                    "start",
                    "-D",
                    self.datadir,
                    "-l",
                    self.logfile,
                    "-o",
                    f"-p {self.port}",
                    "-w",
                    "-t",
                    "60",
                    timeout=90,
                )
                break
            except PostgresUnavailable:
                # most likely another process took the port between probe and start
                if attempt == 4:
                    raise
        pidfile = self.datadir / "postmaster.pid"
        self.pid = int(pidfile.read_text().splitlines()[0])

    def stop(self) -> None:
        """Stop the server (immediate mode) and remove its directory. Idempotent."""
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                self._watchdog.kill()
            with contextlib.suppress(subprocess.SubprocessError):
                self._watchdog.wait(timeout=10)
            if self._watchdog.stdin is not None:
                with contextlib.suppress(OSError):
                    self._watchdog.stdin.close()
            self._watchdog = None
        pid = self.pid
        if pid is None and self.tmpdir is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int((self.datadir / "postmaster.pid").read_text().splitlines()[0])
        if pid is not None and self.bindir is not None and _pid_alive(pid):
            with contextlib.suppress(PostgresUnavailable, subprocess.SubprocessError):
                self._run(
                    self.bindir / "pg_ctl",
                    "stop",
                    "-D",
                    self.datadir,
                    "-m",
                    "immediate",
                    "-w",
                    "-t",
                    "20",
                    timeout=30,
                )
            deadline = time.monotonic() + 10
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.pid = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- databases -------------------------------------------------------------------------

    def _client(self, tool: str, *args: str) -> None:
        assert self.bindir is not None, "server not started"
        cmd = [str(self.bindir / tool), "-h", str(self.socket_dir), "-p", str(self.port)]
        cmd += ["-U", SUPERUSER, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise PostgresUnavailable(f"{tool} {' '.join(args)} failed: {proc.stderr.strip()}")

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create a database (optionally from a template database); return its async URL."""
        if not _DB_NAME.match(name):
            raise ValueError(f"invalid database name {name!r} (want [a-z_][a-z0-9_]*)")
        args = ["--template", template] if template else []
        self._client("createdb", *args, name)
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, disconnecting any sessions still using it."""
        if not _DB_NAME.match(name):
            raise ValueError(f"invalid database name {name!r}")
        self._client("dropdb", "--if-exists", "--force", name)

    @contextlib.contextmanager
    def temporary_database(self, prefix: str = "test") -> Iterator[str]:
        """Create a uniquely named database, yield its async URL, drop it afterwards."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        url = self.create_database(name)
        try:
            yield url
        finally:
            with contextlib.suppress(PostgresUnavailable):
                self.drop_database(name)


def postgres_server_fixture() -> Iterator[PostgresServer]:
    """Generator body for a session-scoped pytest fixture (see the module docstring)."""
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()
