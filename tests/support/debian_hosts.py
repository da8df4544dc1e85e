"""Fresh Debian 12 machines for tests, reached only over SSH.

Tests that treat hosts as real machines (their own root filesystem, systemd as
init, sshd the only way in) boot them here as ``systemd-nspawn`` containers:

* **Image**: ``scripts/build-host-image`` builds a Debian 12 root filesystem
  with everything a GPU host of ours runs (cached under
  ``/var/cache/gpuclusters/host-image/<key>/rootfs``; seconds when cached).
  It has no SSH host keys and no machine id: every host makes its own at its
  first boot. Only systemd's basics and sshd run at boot.
* **Root filesystem per host**: by default an overlayfs whose lower layer is
  the shared image and whose upper layer is the host's own directory (a host
  costs a mount, not a copy of ~800 MB). overlayfs cannot be the *upper*
  layer of another overlayfs, so directories in which the host itself mounts
  overlays (``/var/lib/containerd``: containerd's overlayfs snapshotter) are
  bind-mounted from the host's own directory on this machine's disk
  (``real_fs_dirs``). ``root_mode="copy"`` gives each host a full copy
  instead (about 5 s and 800 MB a host) for tests that need a root without
  overlayfs anywhere.
* **Network**: each host is booted into a named network namespace
  ``gpch-<tag>`` whose ``eth0`` is a veth to the *underlay* bridge
  (``gpcul0`` by default) in this machine's namespace, addressed from a /24
  of 10.232.0.0/16 (``.1`` on the bridge, hosts from ``.2``). The address is
  configured from outside before boot, the way a DHCP server would; nothing
  in the image manages the network. Hosts have no default route (this
  machine forwards packets, and nothing may leave it): they reach each other
  and the bridge's address, and what ``routes`` adds through it.
* **Cgroups**: each host's ``systemd-nspawn`` starts in a cgroup of its own,
  ``gpch-<tag>``, in every mounted hierarchy; with the cgroup namespace
  nspawn sets up, that cgroup is the host's ``/sys/fs/cgroup/<controller>``
  root, which the image remounts writable at boot (``gpc-cgroups-rw``), so
  containerd and kubelet can create cgroups, confined to that subtree.
  Teardown kills what is left in the cgroup, so nothing a host started
  survives it.
* **nspawn flags**: ``-b`` (systemd as PID 1), ``--keep-unit`` and
  ``--register=no`` (this machine need not run systemd or machined:
  without ``--keep-unit`` nspawn asks the system bus for a scope and fails
  where there is none), ``--capability=all`` (netns, veth/bridge/VXLAN,
  unshare, overlay/tmpfs/bind mounts, iptables as root inside),
  ``--network-namespace-path`` (the namespace prepared above),
  ``--hostname`` (not ``--suppress-sync``: it makes open(2) with O_SYNC fail
  with EINVAL, and containerd writes its content store that way),
  ``--link-journal=no``, ``--resolv-conf=off``, ``--timezone=off`` (the
  image's own files), ``--console=read-only`` (the console goes to
  ``console.log``). Environment: ``SYSTEMD_NSPAWN_API_VFS_WRITABLE=network``
  (``/proc/sys/net`` writable: it belongs to the host's own namespace; the
  rest of ``/proc/sys`` is this machine's kernel and stays read-only unless
  ``writable_proc_sys``) and ``SYSTEMD_NSPAWN_TMPFS_TMP=0`` (``/tmp`` on the
  root filesystem, as on Debian).

Teardown is complete whatever state a host was left in: SIGTERM to nspawn
(an orderly poweroff), SIGKILL to everything still in the host's cgroup,
then unmount what was mounted for it, remove its cgroups, namespace, veth and
directory, and finally the bridge. A failed boot shows the console output.

Usage (as a pytest fixture)::

    @pytest.fixture
    def hosts(tmp_path: Path) -> Iterator[list[DebianHost]]:
        with DebianHosts(tmp_path, shared_dir=tmp_path / "shared") as lab:
            yield lab.boot(["gpu-1", "gpu-2"])

    def test_something(hosts: list[DebianHost]) -> None:
        result = hosts[0].run("hostname")
        assert result.stdout.strip() == "gpu-1"
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-host-image"
CGROUP_ROOT = Path("/sys/fs/cgroup")

DEFAULT_SUBNET = "10.232.0.0/24"
DEFAULT_BRIDGE = "gpcul0"
SHARED_MOUNT = "/mnt/gpc-shared"
BOOT_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0

RootMode = Literal["overlay", "copy"]


class HostBootError(RuntimeError):
    """A host did not answer SSH in time (the message ends with its console)."""


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self) -> CommandResult:
        """Raise with both streams unless the command succeeded."""
        if self.rc != 0:
            raise AssertionError(
                f"exit status {self.rc}\n--- stdout ---\n{self.stdout}"
                f"\n--- stderr ---\n{self.stderr}"
            )
        return self


def _sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def build_image() -> Path:
    """The image's root filesystem directory, built by
    ``scripts/build-host-image`` if this machine has not cached it yet."""
    proc = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/build-host-image failed ({proc.returncode}):\n{proc.stderr}")
    return Path(proc.stdout.strip().splitlines()[-1]) / "rootfs"


# -- cgroups ----------------------------------------------------------------------------------


def _hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, name=systemd, and the
    v2 one, hybrid or unified)."""
    if (CGROUP_ROOT / "cgroup.procs").exists():  # pure cgroup v2
        return [CGROUP_ROOT]
    return sorted(
        h
        for h in CGROUP_ROOT.iterdir()
        if not h.is_symlink() and h.is_dir() and (h / "cgroup.procs").exists()
    )


def _make_cgroup(name: str) -> list[Path]:
    made = []
    for hierarchy in _hierarchies():
        top = hierarchy / name
        top.mkdir(exist_ok=True)
        made.append(top)
        # A new v1 cpuset cgroup has no CPUs and no memory nodes: nothing could join it.
        for knob in ("cpuset.cpus", "cpuset.mems"):
            mine = top / knob
            if mine.exists() and not mine.read_text().strip():
                mine.write_text((hierarchy / knob).read_text())
    return made


def _cgroup_tree(name: str) -> list[Path]:
    """Every directory of cgroup ``name``, deepest first."""
    found: list[Path] = []
    for hierarchy in _hierarchies():
        top = hierarchy / name
        if top.is_dir():
            found.extend(Path(d) for d, _, _ in os.walk(top))
    found.sort(key=lambda p: len(p.parts), reverse=True)
    return found


def _cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_tree(name):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
    pids.discard(os.getpid())
    return pids


def _kill_cgroup(name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pids := _cgroup_pids(name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of cgroup {name} survive SIGKILL: {sorted(pids)}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _remove_cgroup(name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for d in _cgroup_tree(name):
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last process is still exiting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


# -- mounts ------------------------------------------------------------------------------------


def _mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    prefix = str(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    found.sort(key=lambda p: len(p.parts), reverse=True)
    return found


def _unmount_all_under(path: Path) -> None:
    for point in _mounts_under(path):
        if _sh("umount", str(point), check=False).returncode != 0:
            _sh("umount", "--lazy", str(point), check=False)
    left = _mounts_under(path)
    if left:
        raise RuntimeError(f"still mounted: {left}")


def _wait_link_gone(name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/sys/class/net/{name}").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"link {name} still exists")
        time.sleep(0.05)


# -- hosts ---------------------------------------------------------------------------------------


class DebianHost:
    """One booted host: its name (also its hostname), underlay address,
    network namespace, root filesystem (as this machine sees it) and SSH."""

    def __init__(self, lab: DebianHosts, name: str, address: str, index: int) -> None:
        self.lab = lab
        self.name = name
        self.address = address
        self.tag = secrets.token_hex(3)
        self.netns = f"gpch-{self.tag}"
        self.veth = f"gpcv{self.tag}"  # this machine's end; eth0 inside
        self.machine = f"gpch-{self.tag}"
        self.cgroup = f"gpch-{self.tag}"
        self.dir = lab.workdir / f"{index:02d}-{name}"
        self.root = self.dir / "root"
        self.console_log = self.dir / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.booted_at: float | None = None
        self.boot_seconds: float | None = None  # nspawn start to first successful SSH

    def __repr__(self) -> str:
        return f"DebianHost({self.name!r}, {self.address})"

    # -- SSH ---------------------------------------------------------------------------------

    def ssh_argv(self, *, connect_timeout: int = 5) -> list[str]:
        """``ssh`` up to and including the destination; append a command."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(self.lab.key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            f"UserKnownHostsFile={self.lab.known_hosts}",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            f"ConnectTimeout={connect_timeout}",
            "-o",
            "LogLevel=ERROR",
            f"root@{self.address}",
        ]

    def run(
        self,
        command: str | Sequence[str],
        *,
        timeout: float = 120,
        input: str | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run ``command`` as root on the host over SSH (a string goes to the
        remote shell as is; a sequence is quoted word by word)."""
        remote = command if isinstance(command, str) else shlex.join(command)
        proc = subprocess.run(
            [*self.ssh_argv(), remote],
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        result = CommandResult(proc.returncode, proc.stdout, proc.stderr)
        return result.check() if check else result

    def console(self, tail: int = 12000) -> str:
        try:
            return self.console_log.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- life cycle (driven by the lab) --------------------------------------------------------

    def _prepare(self, hosts_file: str) -> None:
        lab = self.lab
        self.dir.mkdir(parents=True)
        self.root.mkdir()
        if lab.root_mode == "overlay":
            upper, work = self.dir / "upper", self.dir / "work"
            upper.mkdir()
            work.mkdir()
            _sh(
                "mount",
                "-t",
                "overlay",
                f"gpch-{self.tag}",
                "-o",
                f"lowerdir={lab.image},upperdir={upper},workdir={work}",
                str(self.root),
            )
        else:
            _sh("cp", "-a", "--", f"{lab.image}/.", str(self.root), timeout=600)
        etc = self.root / "etc"
        (etc / "hostname").write_text(f"{self.name}\n")
        (etc / "hosts").write_text(hosts_file)
        ssh_dir = self.root / "root" / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(lab.key.with_suffix(".pub").read_text())
        keys.chmod(0o600)

        _sh("ip", "netns", "add", self.netns)
        _sh(
            "ip",
            "link",
            "add",
            self.veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.netns,
        )
        _sh("ip", "link", "set", self.veth, "master", lab.bridge, "up")
        _sh("ip", "-n", self.netns, "addr", "add", f"{self.address}/{lab.prefixlen}", "dev", "eth0")
        _sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        for dest in lab.routes:
            _sh("ip", "-n", self.netns, "route", "add", dest, "via", lab.gateway)

    def _nspawn_argv(self) -> list[str]:
        lab = self.lab
        argv = [
            "systemd-nspawn",
            "--boot",
            "--keep-unit",
            "--register=no",
            "--capability=all",
            f"--network-namespace-path=/run/netns/{self.netns}",
            f"--directory={self.root}",
            f"--machine={self.machine}",
            f"--hostname={self.name}",
            "--link-journal=no",
            "--resolv-conf=off",
            "--timezone=off",
            "--console=read-only",
        ]
        if lab.root_mode == "overlay":
            for path in lab.real_fs_dirs:
                src = self.dir / "real" / path.strip("/").replace("/", "-")
                src.mkdir(parents=True, exist_ok=True)
                argv.append(f"--bind={src}:{path}")
        if lab.shared_dir is not None:
            argv.append(f"--bind={lab.shared_dir}:{lab.shared_mount}")
        argv.extend(f"--bind={src}:{dst}" for src, dst in lab.binds)
        argv.extend(lab.extra_nspawn_args)
        return argv

    def _start(self) -> None:
        cgroups = _make_cgroup(self.cgroup)

        def enter_cgroup() -> None:  # in the child, before exec
            for cg in cgroups:
                (cg / "cgroup.procs").write_text(str(os.getpid()))

        env = dict(os.environ)
        env["SYSTEMD_NSPAWN_API_VFS_WRITABLE"] = "yes" if self.lab.writable_proc_sys else "network"
        env["SYSTEMD_NSPAWN_TMPFS_TMP"] = "0"
        with self.console_log.open("wb") as log:
            self.proc = subprocess.Popen(
                self._nspawn_argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=enter_cgroup,
            )
        self.booted_at = time.monotonic()

    def _wait_ssh(self, deadline: float) -> None:
        assert self.booted_at is not None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise HostBootError(
                    f"{self.name}: systemd-nspawn exited with status {self.proc.returncode}"
                    f"\n--- console ---\n{self.console()}"
                )
            probe = subprocess.run(
                [*self.ssh_argv(connect_timeout=2), "true"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if probe.returncode == 0:
                self.boot_seconds = time.monotonic() - self.booted_at
                return
            if time.monotonic() > deadline:
                raise HostBootError(
                    f"{self.name} ({self.address}) did not answer SSH within "
                    f"{self.lab.boot_timeout:g}s; last ssh: {probe.stderr.strip()}"
                    f"\n--- console ---\n{self.console()}"
                )
            time.sleep(0.25)

    def _teardown(self) -> list[str]:
        """Remove everything of this host; returns what could not be removed."""
        errors: list[str] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # teardown goes on, and reports
                errors.append(f"{self.name}: {what}: {exc}")

        if self.proc is not None and self.proc.poll() is None:
            # nspawn turns SIGTERM into SIGRTMIN+3 for the container's systemd: poweroff.
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=self.lab.stop_timeout)
        attempt("kill cgroup", lambda: _kill_cgroup(self.cgroup))
        proc = self.proc
        if proc is not None:
            attempt("reap nspawn", lambda: proc.wait(timeout=10))
        attempt("unmount", lambda: _unmount_all_under(self.dir))
        attempt("remove cgroup", lambda: _remove_cgroup(self.cgroup))
        # The veth first: deleting the namespace destroys it too, but later.
        _sh("ip", "link", "del", self.veth, check=False)
        if Path(f"/run/netns/{self.netns}").exists():
            attempt("delete netns", lambda: _sh("ip", "netns", "del", self.netns))
        attempt("wait for the veth to go", lambda: _wait_link_gone(self.veth))
        # nspawn's own scratch directories on this machine, per machine name.
        for scratch in ("propagate", "unix-export"):
            shutil.rmtree(Path("/run/systemd/nspawn") / scratch / self.machine, ignore_errors=True)
        if not _mounts_under(self.dir):
            attempt("remove directory", lambda: shutil.rmtree(self.dir, ignore_errors=False))
        else:
            errors.append(f"{self.name}: {self.dir} kept: mounts remain")
        return errors


class DebianHosts:
    """A set of hosts on one underlay bridge; a context manager whose exit
    (or ``close()``) removes every host and the bridge, pass or fail.

    ``workdir``: where per-host directories go (this machine's disk, not a
    tmpfs: the overlay upper layers and ``real_fs_dirs`` live there).
    ``subnet``: the underlay /24 (or any prefix), inside 10.232.0.0/16 by
    convention; ``.1`` is the bridge's address. ``shared_dir``: a directory of
    this machine bind-mounted into every host at ``shared_mount`` (the
    operator's network filesystem). ``binds``: more ``(source, path in
    host)`` bind mounts. ``writable_proc_sys``: all of ``/proc/sys`` writable
    (it is this machine's kernel's: vm.* and kernel.* change for everyone).
    ``routes``: destinations (CIDRs) hosts reach through this machine, e.g.
    a test gateway address; there is no default route, because this machine
    forwards, and a host must not send anything past it.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        image: Path | None = None,
        subnet: str = DEFAULT_SUBNET,
        bridge: str = DEFAULT_BRIDGE,
        shared_dir: Path | None = None,
        shared_mount: str = SHARED_MOUNT,
        binds: Iterable[tuple[Path, str]] = (),
        root_mode: RootMode = "overlay",
        real_fs_dirs: Iterable[str] = ("/var/lib/containerd",),
        writable_proc_sys: bool = False,
        routes: Iterable[str] = (),
        extra_nspawn_args: Iterable[str] = (),
        boot_timeout: float = BOOT_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
    ) -> None:
        self.workdir = workdir.resolve()
        self.image = image if image is not None else build_image()
        net = ipaddress.ip_network(subnet)
        self.prefixlen = net.prefixlen
        addresses = net.hosts()
        self.gateway = str(next(addresses))
        self._free = [str(a) for a in addresses]
        self.bridge = bridge
        self.shared_dir = shared_dir.resolve() if shared_dir is not None else None
        self.shared_mount = shared_mount
        self.binds = [(Path(s).resolve(), d) for s, d in binds]
        self.root_mode: RootMode = root_mode
        self.real_fs_dirs = list(real_fs_dirs)
        self.writable_proc_sys = writable_proc_sys
        self.routes = list(routes)
        self.extra_nspawn_args = list(extra_nspawn_args)
        self.boot_timeout = boot_timeout
        self.stop_timeout = stop_timeout
        self.hosts: list[DebianHost] = []
        self._bridge_made = False
        self._closed = False

        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.shared_dir is not None:
            self.shared_dir.mkdir(parents=True, exist_ok=True)
        self.key = self.workdir / "id_ed25519"
        self.known_hosts = self.workdir / "known_hosts"
        _sh(
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "gpc-debian-hosts",
            "-f",
            str(self.key),
        )

    # -- context manager -----------------------------------------------------------------------

    def __enter__(self) -> DebianHosts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- hosts ---------------------------------------------------------------------------------

    def _ensure_bridge(self) -> None:
        if self._bridge_made:
            return
        if Path(f"/sys/class/net/{self.bridge}").exists():
            raise RuntimeError(
                f"link {self.bridge} exists already (another lab, or a leftover: "
                f"`ip link del {self.bridge}`); pass bridge= and subnet= of your own"
            )
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _sh("ip", "addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")

    def boot(self, names: int | Sequence[str]) -> list[DebianHost]:
        """Boot hosts (``names``, or that many named ``host-<n>``) in parallel
        and wait until each answers SSH; returns them in order."""
        assert not self._closed, "lab is closed"
        if isinstance(names, int):
            first = len(self.hosts) + 1
            names = [f"host-{i}" for i in range(first, first + names)]
        if len(names) > len(self._free):
            raise RuntimeError(f"subnet has room for {len(self._free)} more hosts")
        self._ensure_bridge()
        new = []
        for name in names:
            host = DebianHost(self, name, self._free.pop(0), len(self.hosts))
            self.hosts.append(host)
            new.append(host)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address}\t{h.name}" for h in self.hosts]
        hosts_file = "\n".join(lines) + "\n"
        for host in new:
            host._prepare(hosts_file)
        for host in new:
            host._start()
        deadline = time.monotonic() + self.boot_timeout
        for host in new:
            host._wait_ssh(deadline)
        return new

    def close(self) -> None:
        """Tear down every host, then the bridge. Raises if anything stays."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for host in reversed(self.hosts):
            errors.extend(host._teardown())
        if self._bridge_made and Path(f"/sys/class/net/{self.bridge}").exists():
            proc = _sh("ip", "link", "del", self.bridge, check=False)
            if proc.returncode != 0:
                errors.append(f"delete bridge {self.bridge}: {proc.stderr.strip()}")
        if errors:
            raise RuntimeError("debian hosts teardown left things behind:\n" + "\n".join(errors))
