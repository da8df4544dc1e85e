"""Control-plane throughput, latency and idle cost on the fake provider.

For each database in ``--db`` (SQLite, and a throwaway PostgreSQL started for
the run), it starts the real server (``gpuclusters server --provider fake``,
fresh home, boot delay 0) over a generated fleet of ``--hosts`` hosts and:

1. **create**: creates ``--clusters`` clusters of ``--nodes`` nodes each through
   the API, ``--concurrency`` requests at a time; prints the API latency of the
   creates, the time until every cluster is ``ready`` with every node
   ``running`` (nodes/s), and how long each cluster took from its create to
   ``ready`` (the first one's, the median and the longest);
2. **idle**: CPU of each server process over ``--idle-s`` seconds with the whole
   fleet running (from ``/proc/<pid>/stat``; 100% = one core);
3. **API latency**: ``clusters get``, ``clusters list`` and ``nodes list`` (first
   page, the default limit) at ``--rate`` requests/s in total for
   ``--latency-s`` seconds, open loop (requests start on schedule whether or not
   earlier ones finished); p50 / p99 / max per endpoint;
4. **one-node change**: scales one cluster down by one node and up again,
   each timed until the cluster is ``ready`` with that many running nodes;
5. **delete**: deletes every cluster and times it until no live cluster or
   node is left (nodes/s).

Readiness is read from the database itself (a count per status every 0.2 s,
printed at most every 5 s),
so the watching adds no API load.  ``--replicas 2`` starts two servers on the
same home and database (PostgreSQL only; see docs/ha.md) and sends the creates
to them in turn; ``--kill`` then kills the second with SIGKILL halfway through
the creates and prints how long the survivor takes to finish the work.

The fake provider makes nodes instantly, so the figures are the control
plane's own cost: API, database, placement and reconcilers. Each run's home
(server logs, SQLite database) is removed at the end; ``BENCH_KEEP_HOME=1``
keeps it, e.g. with ``GPUCLUSTERS_SLOW_QUERY_MS=50`` to read slow queries,
or with ``BENCH_PG_STATEMENTS=1`` for PostgreSQL's own log of every
statement with its time (``postgres.log`` in the kept home). Each phase
prints the CPU the servers, PostgreSQL's processes and the bench used.

    .venv/bin/python bench/control_plane.py --hosts 10000 --clusters 1000 --nodes 10
    .venv/bin/python bench/control_plane.py --db postgresql --replicas 2 --kill \\
        --hosts 1000 --clusters 100 --nodes 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.postgres import PostgresServer

PROJECT_PATH = "/v1/projects/default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_fleet(path: Path, hosts: int) -> None:
    lines = ["hosts:"]
    for i in range(hosts):
        island = f"ib-{i // 32}"
        lines.append(
            f"  - {{name: h{i:05d}, gpu_type: H100_SXM, region: local-1, ib_island: {island}}}"
        )
    path.write_text("\n".join(lines) + "\n")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (
        f"p50={statistics.median(values) * 1000:.1f} ms "
        f"p99={pct(values, 0.99) * 1000:.1f} ms max={max(values) * 1000:.1f} ms "
        f"(n={len(values)})"
    )


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Replica:
    index: int
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    alive: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def server_pid(self) -> int:
        """The server's pid (under py-spy, its child)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        kids = children.read_text().split() if children.exists() else []
        with contextlib.suppress(OSError):
            if "py-spy" in Path(f"/proc/{self.proc.pid}/cmdline").read_text() and kids:
                return int(kids[0])
        return self.proc.pid


@dataclass
class Fleet:
    """The servers of one run and the database they share."""

    home: Path
    database_url: str
    replicas: list[Replica] = field(default_factory=list)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]


@contextlib.contextmanager
def database(kind: str, home: Path) -> Iterator[tuple[str, int | None]]:
    """The database's URL and, for PostgreSQL, its postmaster's pid (whose
    process tree's CPU the bench reports beside the servers')."""
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{home / 'gpuclusters.db'}", None
        return
    server = PostgresServer()
    try:
        if os.environ.get("BENCH_PG_STATEMENTS"):
            # Every statement with its time in PostgreSQL's own log, kept in
            # the home (with BENCH_KEEP_HOME) as postgres.log: what the
            # database spends its CPU on.
            subprocess.run(
                [
                    str(server.bindir / "psql" if server.bindir else "psql"),
                    server.dsn,
                    "-qc",
                    "ALTER SYSTEM SET log_min_duration_statement = 0",
                    "-c",
                    "SELECT pg_reload_conf()",
                ],
                check=True,
                capture_output=True,
            )
        yield server.url, server.pid
    finally:
        with contextlib.suppress(OSError, AssertionError):
            if os.environ.get("BENCH_PG_STATEMENTS"):
                shutil.copy(server.logfile, home / "postgres.log")
        server.stop()


def start_replica(fleet: Fleet, index: int, hosts_file: Path, profile: str | None) -> Replica:
    port = free_port()
    env = dict(
        os.environ,
        GPUCLUSTERS_HOME=str(fleet.home),
        GPUCLUSTERS_FLEET_FILE=str(hosts_file),
        GPUCLUSTERS_FAKE_BOOT_DELAY_S="0",
        GPUCLUSTERS_DATABASE_URL=fleet.database_url,
    )
    exe = Path(sys.executable).parent / "gpuclusters"
    cmd = [str(exe), "server", "--provider", "fake", "--port", str(port)]
    if os.environ.get("BENCH_SERVER_WRAPPER"):  # e.g. a script that counts queries
        cmd = [sys.executable, os.environ["BENCH_SERVER_WRAPPER"], *cmd[1:]]
    if profile:
        spy = Path(sys.executable).parent / "py-spy"
        cmd = [
            str(spy),
            "record",
            "--nonblocking",
            "--format",
            "raw",
            "-r",
            "50",
            "-o",
            profile,
            "--",
            *cmd,
        ]
    log = fleet.home / f"server-{index}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Replica(index=index, port=port, proc=proc, log=log)


async def wait_healthy(replica: Replica, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(base_url=replica.url, timeout=5) as c:
        while time.monotonic() < deadline:
            if replica.proc.poll() is not None:
                raise SystemExit(f"server {replica.index} exited; see {replica.log}")
            with contextlib.suppress(httpx.TransportError):
                if (await c.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise SystemExit(f"server {replica.index} not healthy after {limit_s} s; see {replica.log}")


async def counts(engine: AsyncEngine) -> tuple[dict[str, int], dict[str, int]]:
    """Live clusters per status and live nodes per phase."""
    async with engine.connect() as conn:
        cl = await conn.execute(
            text("SELECT status, count(*) FROM clusters WHERE deleted_at IS NULL GROUP BY status")
        )
        nd = await conn.execute(
            text("SELECT phase, count(*) FROM nodes WHERE deleted_at IS NULL GROUP BY phase")
        )
        return {str(s): int(n) for s, n in cl}, {str(p): int(n) for p, n in nd}


async def time_to_ready(engine: AsyncEngine, first: str) -> tuple[float, list[float]]:
    """Seconds from each live cluster's create to its first ``ready`` (from
    the phase history): the first cluster's, and every one's."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT c.name, c.created_at, min(p.timestamp) FROM clusters c "
                "JOIN cluster_phases p ON p.cluster_id = c.id "
                "WHERE c.deleted_at IS NULL AND p.phase = 'ready' GROUP BY c.name, c.created_at"
            )
        )
        took = {str(name): _seconds(ready) - _seconds(created) for name, created, ready in rows}
    return took[first], sorted(took.values())


def _seconds(ts: object) -> float:
    """A timestamp column as epoch seconds (SQLite gives text, PostgreSQL
    datetimes)."""
    if isinstance(ts, str):
        ts = datetime.fromisoformat(ts)
    assert isinstance(ts, datetime)
    return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp()


PROGRESS_EVERY_S = 5.0  # a progress line at most this often (counts are polled every 0.2 s)


async def wait_counts(engine: AsyncEngine, clusters: int, nodes: int, limit_s: float) -> float:
    """Seconds until exactly `clusters` live clusters, all ready, and `nodes`
    live nodes, all running (0 and 0: everything gone)."""
    t = time.perf_counter()
    last = ""
    shown = -PROGRESS_EVERY_S
    while time.perf_counter() - t < limit_s:
        cl, nd = await counts(engine)
        ok_c = sum(cl.values()) == clusters and cl.get("ready", 0) == clusters
        ok_n = sum(nd.values()) == nodes and nd.get("running", 0) == nodes
        if ok_c and ok_n:
            return time.perf_counter() - t
        state = f"clusters {cl} nodes {nd}"
        elapsed = time.perf_counter() - t
        if state != last and elapsed - shown >= PROGRESS_EVERY_S:
            print(f"  ... {elapsed:6.1f} s  {state}", file=sys.stderr)
            shown = elapsed
        last = state
        await asyncio.sleep(0.2)
    raise SystemExit(f"did not converge in {limit_s} s: {last}")


class Api:
    """Round robin over the live replicas; a request that meets a dead one
    moves on to the next."""

    def __init__(self, fleet: Fleet, key: str) -> None:
        self.fleet = fleet
        self.clients = {
            r.index: httpx.AsyncClient(
                base_url=r.url,
                timeout=120,
                headers={"Authorization": f"Bearer {key}"},
                limits=httpx.Limits(max_connections=64),
            )
            for r in fleet.replicas
        }
        self.turn = 0

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()

    async def call(self, method: str, path: str, **kw: object) -> httpx.Response:
        for _ in range(4):
            live = self.fleet.live()
            replica = live[self.turn % len(live)]
            self.turn += 1
            try:
                return await self.clients[replica.index].request(method, path, **kw)  # type: ignore[arg-type]
            except httpx.TransportError:
                if replica.alive:
                    raise
        raise SystemExit(f"{method} {path}: no live replica answered")


async def create_all(
    api: Api, names: list[str], args: argparse.Namespace, kill: Replica | None
) -> tuple[list[float], float | None]:
    sem = asyncio.Semaphore(args.concurrency)
    latencies: list[float] = []
    started = 0
    killed_at: float | None = None

    async def create(name: str) -> None:
        nonlocal started, killed_at
        async with sem:
            started += 1
            if kill is not None and kill.alive and started > len(names) // 2:
                kill.proc.send_signal(signal.SIGKILL)
                kill.alive = False
                killed_at = time.perf_counter()
                print(f"  killed server {kill.index} (pid {kill.proc.pid})", file=sys.stderr)
            body = {"name": name, "cluster_type": "slurm", "num_gpus": 8 * args.nodes}
            t = time.perf_counter()
            r = await api.call("POST", f"{PROJECT_PATH}/clusters", json=body)
            # 409: the dead replica made it before it died (its answer was lost).
            if r.status_code != 409:
                r.raise_for_status()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(create(n) for n in names))
    return latencies, killed_at


async def steady_latency(api: Api, names: list[str], rate: float, seconds: float) -> None:
    endpoints = {
        "clusters get": lambda: f"{PROJECT_PATH}/clusters/{random.choice(names)}",
        "clusters list": lambda: f"{PROJECT_PATH}/clusters",
        "nodes list": lambda: f"{PROJECT_PATH}/nodes",
    }
    samples: dict[str, list[float]] = {k: [] for k in endpoints}
    kinds = list(endpoints)

    async def one(kind: str) -> None:
        t = time.perf_counter()
        r = await api.call("GET", endpoints[kind]())
        r.raise_for_status()
        samples[kind].append(time.perf_counter() - t)

    tasks = []
    t0 = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(kinds[i % len(kinds)])))
    await asyncio.gather(*tasks)
    print(f"API latency at {rate:.0f} requests/s for {seconds:.0f} s:")
    for kind in kinds:
        print(f"  {kind:14s} {ms(samples[kind])}")


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, its reaped children and its live children
    (PostgreSQL: the postmaster and its backends)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    total = cpu_seconds(pid)
    for kid in children.read_text().split() if children.exists() else []:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{kid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class CpuMeter:
    """CPU used over a phase by the servers, the database (PostgreSQL's
    processes; SQLite runs inside the servers) and this bench (the client):
    on a 2-core machine their sum says whether the machine was the limit."""

    fleet: Fleet
    db_pid: int | None
    start: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float]:
        db = tree_cpu(self.db_pid) if self.db_pid else 0.0
        return servers_cpu(self.fleet), db, time.process_time()

    def reset(self) -> None:
        self.start = self._now()

    def used(self) -> tuple[float, float, float]:
        now = self._now()
        return now[0] - self.start[0], now[1] - self.start[1], now[2] - self.start[2]

    def note(self, wall: float) -> str:
        server, db, client = self.used()
        shares = f"server {100 * server / wall:.0f} %"
        if self.db_pid:
            shares += f", database {100 * db / wall:.0f} %"
        return f"{shares}, bench client {100 * client / wall:.0f} % of a core"


def servers_cpu(fleet: Fleet) -> float:
    """CPU seconds used so far by the live servers (the killed one's stop
    counting when it dies)."""
    return sum(cpu_seconds(r.proc.pid) for r in fleet.live())


async def idle_cpu(fleet: Fleet, seconds: float) -> None:
    pids = {r.index: r.server_pid() for r in fleet.live()}
    before = {i: cpu_seconds(p) for i, p in pids.items()}
    t = time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - t
    for i, pid in pids.items():
        share = (cpu_seconds(pid) - before[i]) / wall * 100
        print(f"idle CPU, server {i}: {share:.1f}% of a core over {wall:.0f} s")


async def metrics_endpoint(api: Api, samples: int) -> None:
    """The server's /metrics at this fleet: answer time (serial GETs with
    the admin key) and size, and how long the server takes to count the
    fleet for its gauges (server/fleet_metrics.py, every 15 s)."""
    took = []
    body = ""
    for _ in range(samples):
        t = time.perf_counter()
        r = await api.call("GET", "/metrics")
        took.append(time.perf_counter() - t)
        r.raise_for_status()
        body = r.text
    refresh_sum = refresh_count = 0.0
    nodes = 0.0
    for line in body.splitlines():
        if line.startswith("gpuclusters_fleet_metrics_refresh_seconds_sum"):
            refresh_sum = float(line.split()[-1])
        elif line.startswith("gpuclusters_fleet_metrics_refresh_seconds_count"):
            refresh_count = float(line.split()[-1])
        elif line.startswith("gpuclusters_nodes{"):
            nodes += float(line.split()[-1])
    refresh = f"{1000 * refresh_sum / refresh_count:.1f} ms" if refresh_count else "n/a"
    print(
        f"/metrics: {ms(took)} over {samples} GETs, {len(body) / 1024:.0f} KiB; "
        f"it counts {nodes:.0f} nodes; fleet count every 15 s: mean {refresh} "
        f"({refresh_count:.0f} refreshes)"
    )


async def one_node_change(api: Api, engine: AsyncEngine, name: str, nodes: int) -> None:
    """Scale one cluster down by a node, then up again (a full fleet has no
    spare host for a scale-up alone): each until the cluster has that many
    running nodes and is ``ready``, as seen through the API."""
    path = f"{PROJECT_PATH}/clusters/{name}"
    query = text(
        "SELECT count(*) FROM nodes n JOIN clusters c ON c.id = n.cluster_id "
        "WHERE c.name = :name AND c.deleted_at IS NULL AND n.deleted_at IS NULL"
    )
    for label, target in (("down", nodes - 1), ("up", nodes)):
        t = time.perf_counter()
        r = await api.call("PATCH", path, json={"num_gpus": 8 * target})
        r.raise_for_status()
        while True:
            async with engine.connect() as conn:
                live = (await conn.execute(query, {"name": name})).scalar_one()
            if live == target:
                view = (await api.call("GET", path)).json()
                running = sum(n["phase"] == "running" for n in view["nodes"])
                if view["status"] == "ready" and running == target:
                    break
            await asyncio.sleep(0.01)
        took = time.perf_counter() - t
        print(
            f"one-node scale-{label}: cluster ready with {target} nodes after {took * 1000:.0f} ms"
        )


async def delete_all(api: Api, names: list[str], concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def delete(name: str) -> None:
        async with sem:
            r = await api.call("DELETE", f"{PROJECT_PATH}/clusters/{name}")
            if r.status_code != 404:
                r.raise_for_status()

    await asyncio.gather(*(delete(n) for n in names))


async def run_db(kind: str, args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix=f"gpuc-bench-{kind}-"))
    hosts = args.hosts or args.clusters * args.nodes
    hosts_file = home / "fleet.yaml"
    write_fleet(hosts_file, hosts)
    n_nodes = args.clusters * args.nodes
    print(
        f"== db={kind} hosts={hosts} clusters={args.clusters} nodes_each={args.nodes} "
        f"({n_nodes} nodes) replicas={args.replicas}{' kill' if args.kill else ''}",
        flush=True,
    )
    with database(kind, home) as (url, db_pid):
        fleet = Fleet(home=home, database_url=url)
        engine = create_async_engine(url)
        api: Api | None = None
        try:
            for i in range(args.replicas):
                profile = f"{args.profile}-{kind}-{i}.txt" if args.profile else None
                fleet.replicas.append(start_replica(fleet, i, hosts_file, profile))
                # The first one prepares the home and the database alone.
                await wait_healthy(fleet.replicas[-1])
            key = tomllib.loads((home / "config.toml").read_text())["api_key"]
            api = Api(fleet, key)
            names = [f"b{i:04d}" for i in range(args.clusters)]
            victim = fleet.replicas[-1] if args.kill else None

            meter = CpuMeter(fleet, db_pid)
            meter.reset()
            t0 = time.perf_counter()
            cpu0 = servers_cpu(fleet)
            latencies, killed_at = await create_all(api, names, args, victim)
            t_sent = time.perf_counter() - t0
            t_ready = t_sent + await wait_counts(engine, args.clusters, n_nodes, args.timeout)
            cpu = servers_cpu(fleet) - cpu0
            print(f"create API latency: {ms(latencies)}; all sent after {t_sent:.1f} s")
            # (Not with a replica killed: its CPU stops counting when it dies.)
            cpu_note = (
                ""
                if killed_at is not None
                else f"; server CPU {cpu:.1f} s ({1000 * cpu / n_nodes:.1f} ms per node, "
                f"{100 * cpu / t_ready:.0f} % of a core)"
            )
            print(f"all ready after {t_ready:.1f} s ({n_nodes / t_ready:.1f} nodes/s){cpu_note}")
            print(f"CPU while creating: {meter.note(t_ready)}")
            first, each = await time_to_ready(engine, names[0])
            print(
                f"first cluster ready {first:.1f} s after its create; each cluster from its "
                f"create to ready: p50 {statistics.median(each):.1f} s, max {max(each):.1f} s"
            )
            if killed_at is not None:
                print(f"survivor finished {time.perf_counter() - killed_at:.1f} s after the kill")

            if not args.skip_steady:
                await asyncio.sleep(5)  # let the last passes settle
                await idle_cpu(fleet, args.idle_s)
                await metrics_endpoint(api, 50)
                meter.reset()
                # The client's own full collections (60 ms here) would stop
                # its loop and count as the server's latency.
                gc.collect()
                gc.freeze()
                t_steady = time.perf_counter()
                await steady_latency(api, names, args.rate, args.latency_s)
                print(f"  CPU meanwhile: {meter.note(time.perf_counter() - t_steady)}")
                if args.nodes >= 2:
                    await one_node_change(api, engine, names[0], args.nodes)

            meter.reset()
            t1 = time.perf_counter()
            cpu0 = servers_cpu(fleet)
            await delete_all(api, names, args.concurrency)
            t_gone = time.perf_counter() - t1
            t_gone += await wait_counts(engine, 0, 0, args.timeout)
            cpu = servers_cpu(fleet) - cpu0
            print(
                f"all deleted after {t_gone:.1f} s ({n_nodes / t_gone:.1f} nodes/s); "
                f"server CPU {cpu:.1f} s ({1000 * cpu / n_nodes:.1f} ms per node)",
                flush=True,
            )
            print(f"CPU while deleting: {meter.note(t_gone)}", flush=True)
        finally:
            if api is not None:
                await api.close()
            await engine.dispose()
            for r in fleet.live():
                r.proc.send_signal(signal.SIGINT)
            for r in fleet.replicas:
                try:
                    r.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            if os.environ.get("BENCH_KEEP_HOME"):
                print(f"kept the server's home (logs, database): {home}", flush=True)
            else:
                shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=0, help="fleet size (default: just enough)")
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4, help="nodes per cluster")
    ap.add_argument("--db", default="sqlite,postgresql", help="comma-separated: sqlite,postgresql")
    ap.add_argument("--replicas", type=int, default=1, help="servers on one database")
    ap.add_argument("--kill", action="store_true", help="SIGKILL the last replica mid-burst")
    ap.add_argument("--concurrency", type=int, default=16, help="create/delete calls in flight")
    ap.add_argument("--rate", type=float, default=50, help="requests/s for the latency phase")
    ap.add_argument("--latency-s", type=float, default=30)
    ap.add_argument("--idle-s", type=float, default=30)
    ap.add_argument("--skip-steady", action="store_true", help="only create and delete")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait per phase")
    ap.add_argument("--profile", default=None, help="py-spy raw stacks to PREFIX-<db>-<i>.txt")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.db.split(",") if k.strip()]
    for k in kinds:
        if k not in ("sqlite", "postgresql"):
            ap.error(f"--db: unknown database {k!r} (sqlite, postgresql)")
    if args.replicas > 1 and "sqlite" in kinds:
        ap.error("--replicas > 1 needs --db postgresql (SQLite is one process's database)")
    if args.kill and args.replicas < 2:
        ap.error("--kill needs --replicas 2 or more")
    for k in kinds:
        asyncio.run(run_db(k, args))


if __name__ == "__main__":
    main()
