"""Slurm clusters on the embedded fleet: create-to-Ready time against its floor.

For 1-, 2- and 4-node Slurm clusters (``--sizes``), ``--repeat`` times each,
one cluster at a time (the default netns fleet has 4 hosts):

* **control plane**: the real server (``gpuclusters server --provider netns``,
  subprocess, fresh home under /tmp, default reconcile interval). POST a
  cluster, poll GET every ``--poll-ms`` until ``ready``; report POST -> ready,
  the cluster's ``phase_history`` and node ``ready_at`` (offsets from the
  POST), the start times of the daemons in its namespaces (read from /proc)
  and the mtimes of the files its steps write in the nodes' /etc overlay
  (which date the steps that start no daemon). Then DELETE and poll until
  404.
* **layers floor**: what a Slurm cluster is now, with no server, database
  or reconcilers: the netns provider and the server's own layers for a
  ``slurm`` cluster (Slurm *and* Kubernetes, ``layers_for_provider``) run in
  this process: N GPU nodes made at once, then ``ensure_control_plane``
  (both control planes, the shared volume's claim bound) beside every
  node's ``join_node``, from the first namespace to all done. The ratio is
  taken against this floor.
* **Slurm floor**: no server. The netns provider and the Slurm stack in this
  process: the controller service node and N GPU nodes (``create`` /
  ``ensure_service_node``), then ``stack.start_controller`` and
  ``stack.join_compute`` for every node at once (``asyncio.gather``), timed
  from the first namespace to every node registered (idle). Every command
  the stack runs goes through a recording shell, which splits the daemons'
  time into steps (mariadbd, slurmdbd, sacctmgr, slurmctld, slurmd
  registration); the first floor also times unit calls and
  mariadb-install-db on an empty datadir.
* **floor with quickack** (``--quickack``): the floor again, with
  ``quickack 1`` on its node namespaces' routes (no delayed ACKs).

Prints one table (min / median over the repeats) and the breakdowns; the
figures and their reading are in docs/benchmarks.md. Needs root and Debian's
Slurm, munge and MariaDB (scripts/setup). Everything made is deleted at the
end, also on error or Ctrl-C, and the bench checks that none of its
namespaces is left (other servers' namespaces are never touched).

    .venv/bin/python bench/provision.py --quickack      # ~3 min on 2 cores
    .venv/bin/python bench/provision.py --sizes 2 --repeat 5 --trace
    .venv/bin/python bench/provision.py --isolation-compare --sizes 1 2 --repeat 3

``--isolation-compare`` runs none of the above: it times a node's boot
(``provider.create``) and Slurm create -> ready with nodes isolated (node
image, user namespace) and as before (the host's directories, no user
namespace), interleaved, and prints them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gpuclusters.core import idblocks
from gpuclusters.core.enums import ClusterType
from gpuclusters.core.nodeshell import CommandResult, NodeShell
from gpuclusters.layers.base import ClusterRef, NodeRef, UnixUser
from gpuclusters.layers.slurm import config as cfg
from gpuclusters.layers.slurm import stack
from gpuclusters.linux import nodeimage
from gpuclusters.linux.layout import NETNS_DIR
from gpuclusters.providers.base import NodeSpec
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.registry import ProviderOptions, make_provider
from gpuclusters.providers.volumes import VolumeStore
from gpuclusters.server.runtime import layers_for_provider

T = TypeVar("T")
PROJECT = "/v1/projects/default"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
LEFT: list[str] = []  # homes of floor runs that could not be cleaned up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_home(tag: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"gpuc-prov-{tag}-", dir="/tmp"))


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f} s"
    return f"{min(xs):.2f} / {med(xs):.2f} s"


# --- namespaces of ours, and what runs in them ---------------------------------------------


def netns_name(node_id: str) -> str:
    return f"gpc-{node_id[:12]}"


def netns_left(node_ids: set[str]) -> list[str]:
    """Those of our nodes whose netns still exists (per ``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    return sorted(netns_name(i) for i in node_ids if netns_name(i) in present)


def _boot_wall() -> float:
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def daemon_starts(node_ids: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """{node label: {daemon: wall-clock start}} for the Slurm daemons running in
    each node's netns, from /proc (start time has 1/CLK_TCK resolution)."""
    tick = os.sysconf("SC_CLK_TCK")
    boot = _boot_wall()
    inodes: dict[tuple[int, int], str] = {}
    for label, node_id in node_ids.items():
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / netns_name(node_id))
            inodes[(st.st_dev, st.st_ino)] = label
    found: dict[str, dict[str, float]] = {label: {} for label in node_ids}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
            owner = inodes.get((st.st_dev, st.st_ino))
            if owner is None:
                continue
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        if comm.startswith("python"):
            with contextlib.suppress(OSError):
                if b"gpuclusters.agent" in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    comm = "agent"
        if comm in DAEMONS or comm == "agent":
            start = boot + int(raw[raw.rindex(")") + 2 :].split()[19]) / tick
            prev = found[owner].get(comm)
            found[owner][comm] = start if prev is None else min(prev, start)
    return found


def set_quickack(netns: str) -> None:
    """``quickack 1`` on every unicast IPv4 route of one of *our* nodes' netns
    (what the provider would do at boot if suggestion 1 of docs/benchmarks.md
    were taken): no delayed ACKs, so Slurm's write-write-read RPCs stop
    waiting 40 ms each for one."""
    out = subprocess.run(
        ["ip", "-n", netns, "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        words = line.split()
        if not words or words[0] in ("broadcast", "multicast") or "quickack" in words:
            continue
        subprocess.run(["ip", "-n", netns, "route", "replace", *words, "quickack", "1"], check=True)


# Files a node's boot and the Slurm layer write, in the node's /etc overlay
# upper layer on the host: their mtimes date the steps that have no daemon.
FILE_MARKS = (
    ("boot", "etc/hostname"),
    ("cluster key", "etc/gpuclusters/slurm/munge.key"),
    ("agent token", "etc/gpuclusters/agent-token"),
    ("accounts", "etc/passwd"),
    ("munge.key", "etc/munge/munge.key"),
    ("slurm.conf", "etc/slurm/slurm.conf"),
    ("slurmdbd.conf", "etc/slurm/slurmdbd.conf"),
)


def file_marks(node_dir: Path) -> dict[str, float]:
    """{step: wall-clock mtime} of the FILE_MARKS present in a node's upper layer."""
    out = {}
    for label, rel in FILE_MARKS:
        with contextlib.suppress(OSError):
            out[label] = (node_dir / "upper" / rel).stat().st_mtime
    return out


# --- a NodeShell that records what the stack does -------------------------------------------


@dataclass(slots=True)
class Call:
    host: str
    kind: str  # run, spawn, stop, status, write, read
    what: tuple[str, ...]
    start: float
    end: float
    ok: bool


@dataclass(slots=True)
class Recorder:
    calls: list[Call] = field(default_factory=list)

    async def timed(
        self, host: str, kind: str, what: Sequence[str], coro: Awaitable[T], ok: Callable[[T], bool]
    ) -> T:
        t = time.perf_counter()
        try:
            result = await coro
        except BaseException:
            self.calls.append(Call(host, kind, tuple(what), t, time.perf_counter(), False))
            raise
        self.calls.append(Call(host, kind, tuple(what), t, time.perf_counter(), ok(result)))
        return result


class RecordingShell:
    """Forwards to a real NodeShell and records every call with its duration."""

    def __init__(self, inner: NodeShell, rec: Recorder) -> None:
        self._inner = inner
        self._rec = rec

    @property
    def hostname(self) -> str:
        return self._inner.hostname

    @property
    def address(self) -> str:
        return self._inner.address

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        def ok(r: CommandResult) -> bool:
            if list(argv) == ["scontrol", "ping"]:
                return r.returncode == 0 and " is UP" in r.stdout
            return r.returncode == 0

        coro = self._inner.run(
            argv, user=user, env=env, stdin=stdin, timeout_s=timeout_s, check=check
        )
        return await self._rec.timed(self.hostname, "run", argv, coro, ok)

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        coro = self._inner.spawn(name, argv, env=env)
        await self._rec.timed(self.hostname, "spawn", [name], coro, lambda _: True)

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        coro = self._inner.stop(name, timeout_s=timeout_s)
        await self._rec.timed(self.hostname, "stop", [name], coro, lambda _: True)

    async def is_running(self, name: str) -> bool:
        coro = self._inner.is_running(name)
        return await self._rec.timed(self.hostname, "status", [name], coro, lambda _: True)

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        coro = self._inner.write_file(path, data, mode=mode, owner=owner)
        return await self._rec.timed(self.hostname, "write", [path], coro, lambda _: True)

    async def read_file(self, path: str) -> bytes | None:
        coro = self._inner.read_file(path)
        return await self._rec.timed(self.hostname, "read", [path], coro, lambda _: True)

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        return self._inner.exec_argv(argv, user=user)


def _as_shell(s: RecordingShell) -> NodeShell:
    return s  # mypy checks RecordingShell against the NodeShell protocol here


# --- floor ----------------------------------------------------------------------------------


@dataclass(slots=True)
class FloorRun:
    nodes: int
    quickack: bool
    total: float  # first namespace -> every node registered
    namespaces: float  # making the controller + N nodes
    daemons: float  # start_controller + joins
    steps: list[tuple[str, float]]  # daemon steps, consecutive, in order
    calls: int  # node commands and helper runs the stack made
    probe_slack: float  # summed sleep before each wait's successful probe
    per_call: dict[str, float] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)


def _trace(calls: list[Call], t0: float) -> list[str]:
    return [
        f"+{c.start - t0:6.3f} {c.end - c.start:6.3f}s {c.host:<16} {c.kind:<6}"
        f" {'ok ' if c.ok else 'NO '} {' '.join(c.what)[:90]}"
        for c in sorted(calls, key=lambda c: c.start)
    ]


def _first(
    calls: list[Call], host: str, pred: Callable[[Call], bool], *, ok: bool = True
) -> Call | None:
    return next((c for c in calls if c.host == host and pred(c) and (c.ok or not ok)), None)


def _is(kind: str, *prefix: str) -> Callable[[Call], bool]:
    return lambda c: c.kind == kind and c.what[: len(prefix)] == prefix


def _has(text: str) -> Callable[[Call], bool]:
    return lambda c: c.kind == "run" and any(text in a for a in c.what)


def _probe_slack(calls: list[Call]) -> float:
    """For every wait (a run of failing probes, then one that succeeds): the gap
    between the last failed probe's end and the successful probe's start. The
    daemon became ready somewhere in that gap plus the probe itself; it is the
    most a faster poll could win."""
    slack = 0.0
    last_fail: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in sorted(calls, key=lambda c: c.start):
        if c.kind != "run":
            continue
        key = (c.host, c.what)
        if not c.ok:
            last_fail[key] = c.end
        elif key in last_fail:
            slack += max(0.0, c.start - last_fail.pop(key))
    return slack


def controller_steps(calls: list[Call], host: str, t0: float) -> list[tuple[str, float]]:
    """Consecutive steps of start_controller, each ending at a milestone call."""
    milestones = [
        ("dirs + munged (munge -n ok)", _first(calls, host, _is("run", "munge"))),
        ("slurm files + mariadb-install-db", _first(calls, host, _is("run", "mariadb-install-db"))),
        ("mariadbd up (SELECT 1 ok)", _first(calls, host, _has("SELECT 1"))),
        ("slurm DB user + grants", _first(calls, host, _has("CREATE USER"))),
        ("slurmdbd up (sacctmgr list ok)", _first(calls, host, _is("run", "sacctmgr", "-n"))),
        ("sacctmgr add cluster", _first(calls, host, _is("run", "sacctmgr", "-i", "add"))),
        ("slurmctld up (scontrol ping ok)", _first(calls, host, _is("run", "scontrol", "ping"))),
    ]
    out, prev = [], t0
    for label, call in milestones:
        if call is None:
            continue
        out.append((label, call.end - prev))
        prev = call.end
    return out


async def _per_call_costs(shell: NodeShell) -> dict[str, float]:
    """Median cost of the stack's unit operations on an idle node."""

    async def timed(op: Callable[[], Awaitable[object]], n: int = 5) -> float:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            await op()
            ts.append(time.perf_counter() - t)
        return med(ts)

    costs = {
        "run (nsenter true)": await timed(lambda: shell.run(["true"])),
        "helper op (is_running)": await timed(lambda: shell.is_running(cfg.SLURMD)),
        "helper op (write_file)": await timed(
            lambda: shell.write_file("/tmp/gpuc-bench", secrets.token_bytes(8))
        ),
        "sinfo --json": await timed(lambda: shell.run(["sinfo", "--json"])),
        "scontrol ping": await timed(lambda: shell.run(["scontrol", "ping"])),
        "sacctmgr list cluster": await timed(
            lambda: shell.run(["sacctmgr", "-n", "-P", "list", "cluster"])
        ),
    }
    # mariadb-install-db as start_controller would run it on a node whose
    # /var/lib/mysql is empty, into a scratch datadir in the node's own /tmp.
    spec = cfg.SlurmSpec(cluster_name="x", controller_host="x", controller_addr="10.0.0.1")
    argv = cfg.mariadb_install_argv(spec)
    scratch = "/tmp/gpuc-bench-db"
    argv = [a if not a.startswith("--datadir=") else f"--datadir={scratch}" for a in argv]
    await shell.run(["install", "-d", "-o", "mysql", "-g", "mysql", scratch])
    t = time.perf_counter()
    await shell.run(argv, timeout_s=120.0)
    costs["mariadb-install-db (empty datadir)"] = time.perf_counter() - t
    await shell.run(["rm", "-rf", scratch])
    return costs


_cleaning = 0  # > 0 while a cleanup runs: interrupts wait until it is done


def _on_sigterm(task: asyncio.Task[Any]) -> None:
    if not _cleaning:
        task.cancel()


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ignore Ctrl-C (and SIGTERM) while cleaning up: an interrupted delete
    would leave namespaces behind. One that came before still ends the run,
    after the cleanup."""
    global _cleaning
    _cleaning += 1
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        _cleaning -= 1
        if not _cleaning:
            signal.signal(signal.SIGINT, previous)


async def _attempt(coro: Awaitable[None], what: str) -> None:
    try:
        await coro
    except Exception as exc:
        print(f"  cleanup: {what} failed: {exc}", file=sys.stderr)


def _service_ids(home: Path) -> list[str]:
    nodes = json.loads((home / "netns-provider.json").read_text())["nodes"]
    return [i for i, rec in nodes.items() if rec.get("kind") == "service"]


async def floor_run(n: int, *, measure_calls: bool, quickack: bool = False) -> FloorRun:
    home = fresh_home("floor")
    provider = make_provider("netns", ProviderOptions(home=home))
    assert isinstance(provider, NetnsNodeProvider)
    cluster_id = uuid.uuid4().hex
    name = f"fl{n}{secrets.token_hex(2)}"
    hosts = (await provider.hosts())[:n]
    if len(hosts) < n:
        raise SystemExit(f"the netns fleet has {len(hosts)} hosts; {n} nodes asked")
    node_ids: set[str] = set()
    rec = Recorder()
    try:
        t0 = time.perf_counter()
        controller = await provider.ensure_service_node(
            cluster_id=cluster_id, cluster_name=name, role="controller", volume_id=None
        )

        async def make(i: int) -> NodeShell:
            node_id = uuid.uuid4().hex
            node_ids.add(node_id)
            spec = NodeSpec(
                node_id=node_id,
                name=f"{name}-n{i}",
                cluster_id=cluster_id,
                cluster_name=name,
                host=hosts[i].name,
                gpu_type=hosts[i].gpu_type,
                compute_class="standard",
            )
            await provider.create(spec)
            return await provider.shell(node_id)

        computes = await asyncio.gather(*(make(i) for i in range(n)))
        if quickack:
            for node_id in [*node_ids, *_service_ids(home)]:
                set_quickack(netns_name(node_id))
        t_ns = time.perf_counter()

        ctl = RecordingShell(controller, rec)
        spec = cfg.SlurmSpec(
            cluster_name=cfg.slurm_cluster_name(name),
            controller_host=ctl.hostname,
            controller_addr=ctl.address,
        )
        key = secrets.token_bytes(32)
        await stack.start_controller(ctl, spec, munge_key=key)
        t_ctl = time.perf_counter()
        joined = await asyncio.gather(
            *(
                stack.join_compute(
                    ctl, RecordingShell(s, rec), spec, munge_key=key, features=["standard"]
                )
                for s in computes
            )
        )
        t_end = time.perf_counter()
        states = {j.name: j.state for j in joined}
        if any(s != "idle" for s in states.values()):
            print(f"  note: nodes registered but not all idle: {states}", file=sys.stderr)

        steps = controller_steps(rec.calls, ctl.hostname, t_ns)
        steps.append(("start_controller rest", t_ctl - t_ns - sum(s for _, s in steps)))
        node_hosts = {s.hostname for s in computes}
        munge_ok = [
            c.end for c in rec.calls if c.host in node_hosts and _is("run", "munge")(c) and c.ok
        ]
        spawned = [c.end for c in rec.calls if c.host in node_hosts and _is("spawn", "slurmd")(c)]
        if munge_ok and spawned:
            steps.append(("nodes: dirs + munged (last node)", max(munge_ok) - t_ctl))
            steps.append(("nodes: slurmd spawned (last node)", max(spawned) - max(munge_ok)))
            steps.append(("nodes: slurmd registered in sinfo (all)", t_end - max(spawned)))
        per_call = await _per_call_costs(controller) if measure_calls else {}
        run = FloorRun(
            nodes=n,
            quickack=quickack,
            total=t_end - t0,
            namespaces=t_ns - t0,
            daemons=t_end - t_ns,
            steps=steps,
            calls=len(rec.calls),
            probe_slack=_probe_slack(rec.calls),
            per_call=per_call,
            trace=_trace(rec.calls, t_ns),
        )
    finally:
        with uninterrupted():
            # Every step even if one fails; what is left is reported below.
            for node_id in node_ids:
                await _attempt(provider.delete(node_id), f"delete node {node_id}")
            await _attempt(
                provider.delete_service_nodes(cluster_id=cluster_id), "delete service nodes"
            )
            await provider.close()
            state = home / "netns-provider.json"
            recorded = json.loads(state.read_text()).get("nodes", {}) if state.exists() else {}
            left = netns_left(node_ids | set(recorded))
            if left or recorded:
                print(f"  LEFT BEHIND by the floor run: {left or list(recorded)} ({home})")
                LEFT.append(str(home))
            else:
                shutil.rmtree(home, ignore_errors=True)
    return run


# --- control plane --------------------------------------------------------------------------


@dataclass(slots=True)
class CpRun:
    nodes: int
    ready: float  # POST -> status ready (seen by the poll)
    delete: float  # DELETE -> 404
    post_latency: float
    phases: list[tuple[str, float]]  # (phase, offset from POST)
    node_ready: list[float]  # offsets of each node's ready_at
    # node label -> daemon start or file written -> offset from POST
    daemons: dict[str, dict[str, float]]
    polls: int  # GETs until ready
    cpu_server: float  # CPU seconds of the server process, POST -> ready
    cpu_commands: float  # ... and of the commands it ran and waited for
    cpu_per_get: float  # server CPU seconds per GET of the cluster (measured once ready)
    wall_per_get: float


class Server:
    def __init__(self, *, isolated: bool | None = None) -> None:
        # None: the server's defaults; True: nodes in user namespaces, from
        # the node image; False: neither (the host's own directories).
        self.isolated = isolated
        self.home = fresh_home("server")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.node_ids: set[str] = set()

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLUSTERS_")}
        env["GPUCLUSTERS_HOME"] = str(self.home)
        if self.isolated is not None:
            env["GPUCLUSTERS_NODE_USERNS"] = "1" if self.isolated else "0"
            if not self.isolated:
                env["GPUCLUSTERS_NODE_IMAGE"] = "none"
        exe = Path(sys.executable).parent / "gpuclusters"
        with open(self.home / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(exe), "server", "--provider", "netns", "--port", str(self.port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def cpu(self) -> tuple[float, float]:
        """(own, waited-for children's) CPU seconds of the server process."""
        assert self.proc is not None
        raw = Path(f"/proc/{self.proc.pid}/stat").read_text()
        f = raw[raw.rindex(")") + 2 :].split()
        tick = os.sysconf("SC_CLK_TCK")
        return (int(f[11]) + int(f[12])) / tick, (int(f[13]) + int(f[14])) / tick

    def provider_nodes(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads((self.home / "netns-provider.json").read_text())
        except FileNotFoundError:
            return {}
        nodes: dict[str, dict[str, Any]] = data.get("nodes", {})
        self.node_ids |= set(nodes)
        return nodes

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    async def cleanup(self) -> bool:
        """Delete whatever the provider still records (as tests/e2e's
        cleanup_netns does); True when none of our namespaces is left."""
        nodes = self.provider_nodes()
        if nodes:
            provider = make_provider("netns", ProviderOptions(home=self.home))
            access: Any = provider
            for node_id, rec in nodes.items():
                if rec.get("kind") == "gpu":
                    await _attempt(provider.delete(node_id), f"delete node {node_id}")
            for cluster_id in {rec.get("cluster_id") for rec in nodes.values()}:
                if cluster_id:
                    await _attempt(
                        access.delete_service_nodes(cluster_id=cluster_id),
                        f"delete service nodes of {cluster_id}",
                    )
            await provider.close()
        left = netns_left(self.node_ids)
        if left:
            print(f"  LEFT BEHIND by the server runs: {left} ({self.home})")
        return not left and not self.provider_nodes()


async def layers_floor_run(n: int) -> float:
    """What a Slurm cluster is today, with no server: the netns provider and
    the same layers the server uses (Slurm *and* Kubernetes, with the shared
    volume's claim bound), run directly: nodes made at once, then
    ``ensure_control_plane`` beside every node's ``join_node``. Seconds from
    the first namespace to every node joined and the control plane done."""
    home = fresh_home("layers")
    provider = make_provider("netns", ProviderOptions(home=home))
    assert isinstance(provider, NetnsNodeProvider)
    layer = layers_for_provider(provider)[ClusterType.SLURM]
    name = f"lf{n}{secrets.token_hex(2)}"
    volume_id = uuid.uuid4().hex
    await VolumeStore(home / "volumes").ensure(volume_id, size_tib=1)
    hosts = (await provider.hosts())[:n]
    refs = tuple(
        NodeRef(node_id=uuid.uuid4().hex, name=f"{name}-standard-{i}", host=h.name,
                compute_class="standard")
        for i, h in enumerate(hosts)
    )  # fmt: skip
    cref = ClusterRef(
        cluster_id=uuid.uuid4().hex,
        name=name,
        cluster_type="slurm",
        gpu_type=hosts[0].gpu_type,
        volume_id=volume_id,
        users=(UnixUser(name="bench", uid=20000, admin=True),),
        nodes=refs,
    )
    try:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                provider.create(
                    NodeSpec(node_id=r.node_id, name=r.name, cluster_id=cref.cluster_id,
                             cluster_name=name, host=r.host, gpu_type=cref.gpu_type,
                             compute_class="standard", volume_id=volume_id)
                )
                for r in refs
            )
        )  # fmt: skip

        async def join(r: NodeRef) -> None:
            while not await layer.join_node(cref, r):  # noqa: ASYNC110 (a step polled until done)
                await asyncio.sleep(0.05)

        await asyncio.gather(layer.ensure_control_plane(cref), *(join(r) for r in refs))
        return time.perf_counter() - t0
    finally:
        with uninterrupted():
            for r in refs:
                await _attempt(provider.delete(r.node_id), f"delete {r.name}")
            await _attempt(layer.delete(cref), f"delete {name}'s service nodes")
            await provider.close()
            await VolumeStore(home / "volumes").delete(volume_id)
            shutil.rmtree(home, ignore_errors=True)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


async def wait_healthy(c: httpx.AsyncClient, server: Server) -> None:
    for _ in range(600):
        assert server.proc is not None
        if server.proc.poll() is not None:
            raise SystemExit(f"server exited; see {server.home / 'server.log'}")
        with contextlib.suppress(httpx.TransportError):
            if (await c.get("/healthz")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise SystemExit("server did not answer /healthz within 30 s")


async def cp_run(c: httpx.AsyncClient, server: Server, n: int, name: str, poll_s: float) -> CpRun:
    url = f"{PROJECT}/clusters"
    cpu0 = server.cpu()
    wall0, t0 = time.time(), time.perf_counter()
    r = await c.post(url, json={"name": name, "cluster_type": "slurm", "num_gpus": 8 * n})
    post_latency = time.perf_counter() - t0
    r.raise_for_status()
    deadline = t0 + 300
    polls = 0
    while True:
        r = await c.get(f"{url}/{name}")
        polls += 1
        r.raise_for_status()
        body = r.json()
        if body["status"] == "ready":
            t_ready = time.perf_counter() - t0
            cpu1 = server.cpu()
            break
        if body["status"] == "failed" or time.perf_counter() > deadline:
            raise SystemExit(f"cluster {name}: {body['status']}: {body['status_message']}")
        await asyncio.sleep(poll_s)

    # Where its daemons run: the provider's records of this cluster's nodes.
    nodes = server.provider_nodes()
    labels: dict[str, str] = {}
    for node_id, rec in nodes.items():
        if rec.get("cluster_name") != name:
            continue
        role = rec.get("role") or "gpu"
        label = role if role != "gpu" else f"gpu:{rec.get('hostname')}"
        labels[label] = node_id
    starts = daemon_starts(labels)
    for label, node_id in labels.items():
        starts[label].update(file_marks(Path(nodes[node_id]["nodes_dir"]) / node_id))
    daemons = {k: {d: t - wall0 for d, t in v.items()} for k, v in starts.items() if v}

    phases = [(p["phase"], _ts(p["timestamp"]) - wall0) for p in body["phase_history"]]
    node_ready = sorted(_ts(x["ready_at"]) - wall0 for x in body["nodes"] if x.get("ready_at"))

    # What one poll costs the server (it shares the 2 cores with the nodes).
    cpu_a, t_a = server.cpu(), time.perf_counter()
    for _ in range(20):
        (await c.get(f"{url}/{name}")).raise_for_status()
    cpu_get = (server.cpu()[0] - cpu_a[0]) / 20
    wall_get = (time.perf_counter() - t_a) / 20

    t1 = time.perf_counter()
    r = await c.delete(f"{url}/{name}", params={"delete_volume": "true"})
    r.raise_for_status()
    while (await c.get(f"{url}/{name}")).status_code != 404:
        if time.perf_counter() > t1 + 120:
            raise SystemExit(f"cluster {name} not gone 120 s after DELETE")
        await asyncio.sleep(poll_s)
    t_gone = time.perf_counter() - t1
    return CpRun(
        nodes=n,
        ready=t_ready,
        delete=t_gone,
        post_latency=post_latency,
        phases=phases,
        node_ready=node_ready,
        daemons=daemons,
        polls=polls,
        cpu_server=cpu1[0] - cpu0[0],
        cpu_commands=cpu1[1] - cpu0[1],
        cpu_per_get=cpu_get,
        wall_per_get=wall_get,
    )


# --- node isolation side by side (--isolation-compare) --------------------------------------


async def boot_run(isolated: bool, index: int) -> float:
    """One GPU node made by the provider, from nothing to its init running
    and its shell answering (``provider.create``): isolated, in a user
    namespace on the project block ``index`` and from the node image; or
    with neither (the host's own directories); seconds. A first boot, as in
    a new cluster: an isolated node's files are shifted into its block."""
    home = fresh_home("boot")
    image = nodeimage.newest_built() if isolated else None
    if isolated and image is None:
        raise SystemExit("no node image built: run scripts/build-node-image")
    opts = ProviderOptions(home=home, node_userns=isolated, node_image=image)
    provider = make_provider("netns", opts)
    assert isinstance(provider, NetnsNodeProvider)
    host = (await provider.hosts())[0]
    node_id = uuid.uuid4().hex
    spec = NodeSpec(
        node_id=node_id,
        name=f"bt{secrets.token_hex(2)}-n0",
        cluster_id=uuid.uuid4().hex,
        cluster_name=f"bt{secrets.token_hex(2)}",
        host=host.name,
        gpu_type=host.gpu_type,
        compute_class="standard",
        host_ids=idblocks.block(index) if isolated else None,
    )
    try:
        if isolated:
            # A server probes its host's idmapped mounts once per process,
            # before its first user-namespace node: not a node's boot.
            await provider._check_idmap()
        t0 = time.perf_counter()
        await provider.create(spec)
        return time.perf_counter() - t0
    finally:
        with uninterrupted():
            await _attempt(provider.delete(node_id), f"delete node {node_id}")
            await provider.close()
            if netns_left({node_id}):
                print(f"  LEFT BEHIND by the boot run: {node_id} ({home})")
                LEFT.append(str(home))
            else:
                shutil.rmtree(home, ignore_errors=True)


async def run_isolation_compare(args: argparse.Namespace) -> None:
    """Node boot and Slurm cluster create -> ready, with the nodes as before
    issue 24's isolation (the host's directories, no user namespace) and as
    now (node image, user namespace), interleaved (the order alternates each
    repeat) so both see the same machine; two servers, one per mode."""
    modes = {"before": False, "isolated": True}
    boots: dict[str, list[float]] = {m: [] for m in modes}
    cps: dict[tuple[str, int], list[CpRun]] = {(m, n): [] for m in modes for n in args.sizes}
    servers = {m: Server(isolated=u) for m, u in modes.items()}
    clean = {m: False for m in modes}
    t_bench = time.perf_counter()
    try:
        clients: dict[str, httpx.AsyncClient] = {}
        for m, server in servers.items():
            server.start()
            c = httpx.AsyncClient(base_url=server.url, timeout=60)
            clients[m] = c
            await wait_healthy(c, server)
            key = tomllib.loads((server.home / "config.toml").read_text())["api_key"]
            c.headers["Authorization"] = f"Bearer {key}"
        for i in range(args.repeat):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for m in order:
                boots[m].append(await boot_run(modes[m], i))
                print(f"  node boot, {m}: {boots[m][-1]:.2f} s")
            for n in args.sizes:
                for m in order:
                    name = f"bi{n}n{i}{secrets.token_hex(2)}"
                    r = await cp_run(clients[m], servers[m], n, name, args.poll_ms / 1000)
                    cps[(m, n)].append(r)
                    print(f"  {m}:", end="")
                    print_cp(r)
        for c in clients.values():
            await c.aclose()
    finally:
        with uninterrupted():
            for m, server in servers.items():
                server.stop()
                clean[m] = await server.cleanup()
                if clean[m] and not args.keep_home:
                    shutil.rmtree(server.home, ignore_errors=True)
    print()
    print("min / median over the repeats; ratio = median isolated / median before")
    print("| what | before (host dirs, no userns) | isolated (image, userns) | ratio |")
    print("|---|---|---|---|")
    b, a = boots["before"], boots["isolated"]
    print(f"| node boot (provider.create) | {fmt(b)} | {fmt(a)} | {med(a) / med(b):.2f} |")
    for n in args.sizes:
        b = [r.ready for r in cps[("before", n)]]
        a = [r.ready for r in cps[("isolated", n)]]
        print(
            f"| Slurm cluster, {n} node(s), create->ready | {fmt(b)} | {fmt(a)} "
            f"| {med(a) / med(b):.2f} |"
        )
    left = "none" if all(clean.values()) and not LEFT else f"SOME (kept: {LEFT})"
    print(f"\nbench took {time.perf_counter() - t_bench:.0f} s; namespaces of ours left: {left}")


# --- report ---------------------------------------------------------------------------------


def print_cp(run: CpRun) -> None:
    print(
        f"  control plane {run.nodes} node(s): ready {run.ready:.2f} s "
        f"(POST {run.post_latency * 1000:.0f} ms), delete -> 404 {run.delete:.2f} s;"
        f" {run.polls} GETs; server CPU {run.cpu_server:.2f} s"
        f" + its commands {run.cpu_commands:.2f} s; one GET {run.wall_per_get * 1000:.0f} ms"
        f" ({run.cpu_per_get * 1000:.0f} ms CPU)"
    )
    phases = "  ".join(f"{p} +{t:.2f}" for p, t in run.phases)
    print(f"    phases: {phases}")
    print(f"    nodes ready_at: {', '.join(f'+{t:.2f}' for t in run.node_ready)}")
    for label in sorted(run.daemons, key=lambda x: (x.startswith("gpu"), x)):
        ds = sorted(run.daemons[label].items(), key=lambda kv: kv[1])
        print(f"    {label:<22} " + "  ".join(f"{d} +{t:.2f}" for d, t in ds))


def print_floor(run: FloorRun, *, trace: bool = False) -> None:
    what = "floor+quickack" if run.quickack else "floor"
    print(
        f"  {what} {run.nodes} node(s): {run.total:.2f} s = namespaces {run.namespaces:.2f}"
        f" + daemons {run.daemons:.2f} ({run.calls} node calls,"
        f" probe slack {run.probe_slack:.2f} s)"
    )
    for label, dt in run.steps:
        print(f"    {label:<42} {dt:6.3f} s")
    for label, dt in run.per_call.items():
        print(f"    per call: {label:<32} {dt * 1000:6.1f} ms")
    if trace:
        print("    trace (offset from the last namespace made, duration, node, call):")
        for line in run.trace:
            print(f"      {line}")


def print_table(
    cp: dict[int, list[CpRun]],
    fl: dict[int, list[FloorRun]],
    qa: dict[int, list[FloorRun]],
    lf: dict[int, list[float]],
) -> None:
    extra = any(qa.values())
    print()
    print("min / median over the repeats")
    print(
        "| nodes | control plane create->ready | floor: Slurm + Kubernetes layers "
        "| ratio (median cp / median layers floor) | floor: Slurm daemons (ns + daemons) "
        "| Slurm daemons only | delete->404 |"
        + (" Slurm floor with quickack routes |" if extra else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if extra else ""))
    for n in sorted(cp):
        ready = [r.ready for r in cp[n]]
        total = [r.total for r in fl[n]]
        daemons = [r.daemons for r in fl[n]]
        ratio = med(ready) / med(lf[n])
        gone = [r.delete for r in cp[n]]
        row = (
            f"| {n} | {fmt(ready)} | {fmt(lf[n])} | {ratio:.1f}x | {fmt(total)} "
            f"| {fmt(daemons)} | {fmt(gone)} |"
        )
        if extra:
            row += f" {fmt([r.total for r in qa[n]])} |"
        print(row)


async def run(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("the embedded fleet needs root")
    for exe in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db"):
        if shutil.which(exe) is None:
            raise SystemExit(f"{exe} not found: run scripts/setup first")
    if max(args.sizes) > 4:
        raise SystemExit("the default netns fleet has 4 hosts: at most 4 nodes")
    poll_s = args.poll_ms / 1000
    # SIGTERM cancels like Ctrl-C does, so the cleanup below runs either way.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, _on_sigterm, task)
    cp: dict[int, list[CpRun]] = {n: [] for n in args.sizes}
    fl: dict[int, list[FloorRun]] = {n: [] for n in args.sizes}
    qa: dict[int, list[FloorRun]] = {n: [] for n in args.sizes}
    lf: dict[int, list[float]] = {n: [] for n in args.sizes}
    server = Server()
    server_clean = False
    t_bench = time.perf_counter()
    try:
        server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await wait_healthy(c, server)
            key = tomllib.loads((server.home / "config.toml").read_text())["api_key"]
            c.headers["Authorization"] = f"Bearer {key}"
            first = True
            for n in args.sizes:
                for i in range(args.repeat):
                    # Alternate which goes first, so neither always runs on a
                    # machine just warmed up (or loaded) by the other.
                    order = ["floor", "layers", "cp"] if i % 2 == 0 else ["cp", "layers", "floor"]
                    if args.quickack:
                        order.insert(order.index("floor") + 1, "quickack")
                    for what in order:
                        if what == "floor":
                            f = await floor_run(n, measure_calls=first)
                            first = False
                            fl[n].append(f)
                            print_floor(f, trace=args.trace)
                        elif what == "layers":
                            lf[n].append(await layers_floor_run(n))
                            print(f"  layers floor {n} node(s): {lf[n][-1]:.2f} s")
                        elif what == "quickack":
                            f = await floor_run(n, measure_calls=False, quickack=True)
                            qa[n].append(f)
                            print_floor(f, trace=args.trace)
                        else:
                            name = f"bp{n}n{i}{secrets.token_hex(2)}"
                            r = await cp_run(c, server, n, name, poll_s)
                            cp[n].append(r)
                            print_cp(r)
    finally:
        with uninterrupted():
            server.stop()
            server_clean = await server.cleanup()
            if server_clean and not args.keep_home:
                shutil.rmtree(server.home, ignore_errors=True)
    print_table(cp, fl, qa, lf)
    left = "none" if server_clean and not LEFT else f"SOME (see above; kept: {server.home} {LEFT})"
    print(f"\nbench took {time.perf_counter() - t_bench:.0f} s; namespaces of ours left: {left}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument(
        "--quickack",
        action="store_true",
        help="also run each floor with `quickack 1` on its nodes' routes (no delayed ACKs)",
    )
    ap.add_argument("--trace", action="store_true", help="print every node call of the floor")
    ap.add_argument("--keep-home", action="store_true", help="keep the server's home")
    ap.add_argument(
        "--isolation-compare",
        action="store_true",
        help="instead: node boot and create->ready with nodes as before issue 24 (host dirs, "
        "no user namespace) and isolated (node image, user namespace), side by side",
    )
    args = ap.parse_args()
    asyncio.run(run_isolation_compare(args) if args.isolation_compare else run(args))


if __name__ == "__main__":
    main()
