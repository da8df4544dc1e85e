"""Machines around the server, made of network namespaces, for tests that
use the service as its users and the internet would.

* ``Laptop``: a user's own machine. A network namespace whose only link is
  a veth to the server machine; the host end's address is the *gateway
  address* (the server's ``--public-host``), and the laptop routes
  everything through it, so it reaches exactly what the gateway serves. A
  fresh non-root Unix account with no rights on the server machine runs
  the CLI from its own virtual environment (``python -m venv``, whose only
  addition is a ``.pth`` line pointing at the project's installed packages
  and a ``gpuclusters`` entry script), plus the system's ``ssh`` and
  ``kubectl``.
* ``Outside``: "the internet": a namespace on a veth of its own serving
  HTTP; cluster nodes reach it only through the host's NAT (egress).

Addresses come from 10.230.0.0/16 (this machine's own test networks, never
routed anywhere); every object is removed on close, and a close after a
failed setup removes what was made.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOL_PREFIX = "10.230"
SYSTEM_PYTHON = "/usr/bin/python3"


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def _used_blocks() -> set[int]:
    out = json.loads(sh("ip", "-j", "-4", "addr", "show").stdout or "[]")
    used = set()
    for link in out:
        for info in link.get("addr_info", []):
            parts = str(info.get("local", "")).split(".")
            if ".".join(parts[:2]) == POOL_PREFIX:
                used.add(int(parts[2]))
    return used


class VethNamespace:
    """A namespace joined to the host by a veth: host end ``.1``, inside ``.2``
    of ``10.230.<block>.0/30``."""

    def __init__(self, kind: str) -> None:
        tag = secrets.token_hex(3)
        self.netns = f"gpct-{kind}-{tag}"
        self.host_if = f"gpct{kind[0]}{tag}"
        self.gateway = self.address = ""
        self._made = False

    def up(self) -> None:
        # Chosen now, after the namespaces made before this one took theirs.
        used = _used_blocks()
        block = next(b for b in range(1, 255) if b not in used)
        self.gateway = f"{POOL_PREFIX}.{block}.1"
        self.address = f"{POOL_PREFIX}.{block}.2"
        peer = self.host_if + "p"
        sh("ip", "netns", "add", self.netns)
        self._made = True
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", peer,
           "netns", self.netns)  # fmt: skip
        sh("ip", "-n", self.netns, "link", "set", peer, "name", "eth0")
        sh("ip", "addr", "add", f"{self.gateway}/30", "dev", self.host_if)
        sh("ip", "link", "set", self.host_if, "up")
        sh("ip", "-n", self.netns, "addr", "add", f"{self.address}/30", "dev", "eth0")
        sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")

    def close(self) -> None:
        if not self._made:
            return
        sh("ip", "link", "del", self.host_if, check=False)
        sh("ip", "netns", "pids", self.netns, check=False)
        for pid in sh("ip", "netns", "pids", self.netns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        sh("ip", "netns", "del", self.netns, check=False)
        self._made = False


class Outside(VethNamespace):
    """An HTTP server on the "internet" side; ``url(path)`` is what nodes fetch."""

    def __init__(self, content: str) -> None:
        super().__init__("out")
        self.content = content
        self.dir = Path(tempfile.mkdtemp(prefix="gpct-www-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 8080

    def up(self) -> None:
        super().up()
        (self.dir / "hello.txt").write_text(self.content)
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, "-m", "http.server",
             str(self.port), "--bind", self.address, "--directory", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            connect = f"import socket; socket.create_connection(('{self.address}', {self.port}), 1)"
            probe = sh("ip", "netns", "exec", self.netns, "python3", "-c", connect, check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("the outside HTTP server did not start")

    def url(self, path: str = "hello.txt") -> str:
        return f"http://{self.address}:{self.port}/{path}"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Laptop(VethNamespace):
    """A user's machine: netns + non-root account + the CLI in its own venv."""

    def __init__(self, project_root: Path) -> None:
        super().__init__("lap")
        self.user = f"gpclap{secrets.token_hex(3)}"
        self.root = Path(tempfile.mkdtemp(prefix="gpct-laptop-"))
        self.home = self.root / "home"
        # The user's own temporary directory: tools that keep fixed names under
        # the machine's /tmp (SkyPilot's /tmp/<wheel hash>/) would otherwise meet
        # files of an earlier laptop user, or leave theirs to the next.
        self.tmp = self.root / "tmp"
        self.venv = self.home / "venv"
        self.project_root = project_root
        self._user_made = False
        self._mounted: Path | None = None

    def up(self) -> None:
        super().up()
        sh("ip", "-n", self.netns, "route", "add", "default", "via", self.gateway)
        os.chmod(self.root, 0o755)
        sh("useradd", "--home-dir", str(self.home), "--create-home", "--shell", "/bin/bash",
           self.user)  # fmt: skip
        self._user_made = True
        self.tmp.mkdir(mode=0o700)
        shutil.chown(self.tmp, self.user, self.user)
        # The user's own virtual environment with the CLI in it.
        # Debian's own Python 3.11 (the project's interpreter may live where
        # this user cannot read).
        self.run(SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(self.venv), check=True)
        # The project's installed packages (scripts/setup's .venv; read-only to
        # the user), its source first: the editable install's own entry names
        # the checkout's path, which the user may not reach (a clone under
        # /root, mode 0700).
        view = self._project_view()
        site = view / ".venv" / "lib" / "python3.11" / "site-packages"
        pth = self.venv / "lib" / "python3.11" / "site-packages" / "gpuclusters-project.pth"
        entry = self.venv / "bin" / "gpuclusters"
        self.run("sh", "-c",
                 f"printf '%s\\n' '{view / 'src'}' \"import site; site.addsitedir('{site}')\""
                 f" > {pth} && "
                 f"printf '#!{self.venv}/bin/python\\nfrom gpuclusters.cli.main import main\\n"
                 f"main()\\n' > {entry} && chmod +x {entry}",
                 check=True)  # fmt: skip

    def _project_view(self) -> Path:
        """The checkout as the laptop's user can read it: itself when every
        directory above it lets others through, else a read-only bind mount
        of it under the laptop's own directory (unmounted by ``close``
        before anything there is removed)."""
        blocked = [d for d in self.project_root.resolve().parents if not os.stat(d).st_mode & 0o001]
        if not blocked:
            return self.project_root
        view = self.root / "project"
        view.mkdir()
        sh("mount", "--bind", str(self.project_root), str(view))
        self._mounted = view
        sh("mount", "-o", "remount,bind,ro", str(view))
        return view

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    def popen(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``argv`` started in the background as ``run`` runs it (stdout and
        stderr piped, text); the caller waits for it."""
        return subprocess.Popen(
            self._command(argv, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(self.home),
        )

    def _command(self, argv: tuple[str, ...], env: dict[str, str] | None) -> list[str]:
        base = {
            "HOME": str(self.home),
            "USER": self.user,
            "LOGNAME": self.user,
            "PATH": f"{self.venv}/bin:/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "COLUMNS": "200",
            "NO_COLOR": "1",
            "TMPDIR": str(self.tmp),
        }
        base.update(env or {})
        return ["ip", "netns", "exec", self.netns, "setpriv", f"--reuid={self.user}",
                f"--regid={self.user}", "--init-groups", "--", "env", "-i",
                *(f"{k}={v}" for k, v in base.items()), *argv]  # fmt: skip

    def run(
        self,
        *argv: str,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        timeout: float = 120,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` as the laptop's user, inside the laptop's network, with a
        plain login environment (no GPUCLUSTERS_* of the test process)."""
        cmd = self._command(argv, env)
        result = subprocess.run(
            cmd,
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(self.home),
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"laptop: {' '.join(argv)} exited {result.returncode}\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def close(self) -> None:
        if self._user_made:
            # userdel refuses while a process of the user lives, and a killed
            # one lives until its parent reaps it: wait for none to be left.
            deadline = time.monotonic() + 10
            while sh("pgrep", "-u", self.user, check=False).returncode == 0:
                sh("pkill", "-KILL", "-u", self.user, check=False)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            sh("userdel", self.user, check=False)
            self._user_made = False
        super().close()
        if self._mounted is not None:
            # Never remove files through the view: they are the checkout's.
            sh("umount", str(self._mounted))
            self._mounted = None
        shutil.rmtree(self.root, ignore_errors=True)
