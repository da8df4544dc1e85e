"""In-process fake node provider.

Nodes are records, not machines: a node "boots" for ``boot_delay_s`` and then
runs. The records are kept in a small SQLite database under the server's
home (``fake-provider.sqlite``) so that they outlive a server crash exactly
like real VMs would, which is what makes crash tests meaningful: after
``kill -9`` the restarted control plane must re-adopt these instances, not
create them twice, and delete the ones it no longer knows (orphans).

SQLite rather than a file rewritten per change: each operation touches one
row (a fleet of 10,000 nodes costs the same per create as one of ten), and
several server replicas sharing a home see one set of instances, as they
would see one cloud. The table's unique ``host`` column is the provider's
own "one node per host" rule, across processes. Operations are single
statements in autocommit-sized transactions, fast enough to run on the event
loop; WAL lets readers run beside a writer.

Hosts named in ``fail_hosts`` make every node placed on them fail, to
exercise failure paths. ``create_delay_s`` makes each create call take that
long before the instance exists (a cloud API's latency), so tests can catch a
replica in the middle of a provider call.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuclusters.providers.base import (
    HostSpec,
    Instance,
    InstanceState,
    NodeProvider,
    NodeSpec,
    PermanentProviderError,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS instances (
    node_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    host TEXT NOT NULL UNIQUE,
    compute_class TEXT NOT NULL,
    booted_at REAL NOT NULL,
    boots INTEGER NOT NULL DEFAULT 1,
    provisions INTEGER NOT NULL DEFAULT 1
)
"""
_COLUMNS = ("name", "cluster_id", "host", "compute_class", "booted_at", "boots", "provisions")


def open_state(path: Path) -> sqlite3.Connection:
    """The provider's database (made on first use); also what tests read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash
    db.execute(_SCHEMA)
    return db


def read_instances(path: Path) -> dict[str, dict[str, Any]]:
    """Every instance record by node id (for tests and tools)."""
    if not path.exists():
        return {}
    db = open_state(path)
    try:
        rows = db.execute(f"SELECT node_id, {', '.join(_COLUMNS)} FROM instances").fetchall()
    finally:
        db.close()
    return {r[0]: dict(zip(_COLUMNS, r[1:], strict=True)) for r in rows}


def write_instances(path: Path, instances: dict[str, dict[str, Any]]) -> None:
    """Replace every record (for tests that stage a crash's leftovers)."""
    db = open_state(path)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM instances")
        for node_id, rec in instances.items():
            db.execute(
                f"INSERT INTO instances (node_id, {', '.join(_COLUMNS)}) VALUES (?{', ?' * 7})",
                (node_id, *(rec.get(c, 1) for c in _COLUMNS)),
            )
        db.execute("COMMIT")
    finally:
        db.close()


@dataclass(slots=True)
class FakeProviderConfig:
    fleet: list[HostSpec]
    state_file: Path
    boot_delay_s: float = 1.0
    fail_hosts: frozenset[str] = field(default_factory=frozenset)
    create_delay_s: float = 0.0


class FakeNodeProvider(NodeProvider):
    name = "fake"

    def __init__(self, config: FakeProviderConfig) -> None:
        self._config = config
        self._hosts = {h.name: h for h in config.fleet}
        self._db = open_state(config.state_file)

    async def close(self) -> None:
        self._db.close()

    def _record(self, node_id: str) -> dict[str, Any] | None:
        row = self._db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM instances WHERE node_id = ?", (node_id,)
        ).fetchone()
        return None if row is None else dict(zip(_COLUMNS, row, strict=True))

    def _instance(self, node_id: str, rec: dict[str, Any] | None) -> Instance:
        if rec is None:
            return Instance(node_id=node_id, host="", state=InstanceState.MISSING)
        if rec["host"] in self._config.fail_hosts:
            return Instance(
                node_id=node_id,
                host=rec["host"],
                state=InstanceState.FAILED,
                message=f"host {rec['host']} failed to boot the node (injected by fail_hosts)",
            )
        booted = time.time() >= rec["booted_at"] + self._config.boot_delay_s
        return Instance(
            node_id=node_id,
            host=rec["host"],
            state=InstanceState.RUNNING if booted else InstanceState.BOOTING,
        )

    # -- contract ------------------------------------------------------------

    async def hosts(self) -> list[HostSpec]:
        return list(self._config.fleet)

    async def create(self, spec: NodeSpec) -> Instance:
        if (rec := self._record(spec.node_id)) is not None:
            return self._instance(spec.node_id, rec)
        if spec.host not in self._hosts:
            raise PermanentProviderError(f"unknown host {spec.host!r}")
        if self._config.create_delay_s:
            await asyncio.sleep(self._config.create_delay_s)
            if (rec := self._record(spec.node_id)) is not None:
                return self._instance(spec.node_id, rec)  # made meanwhile
        try:
            self._db.execute(
                "INSERT INTO instances (node_id, name, cluster_id, host, compute_class, booted_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    spec.node_id,
                    spec.name,
                    spec.cluster_id,
                    spec.host,
                    spec.compute_class,
                    time.time(),
                ),
            )
        except sqlite3.IntegrityError:
            if (rec := self._record(spec.node_id)) is not None:
                return self._instance(spec.node_id, rec)  # another replica made it
            # One node per host is the control plane's rule too; a second
            # node here means a bug upstream, so refuse loudly.
            holder = self._db.execute(
                "SELECT name FROM instances WHERE host = ?", (spec.host,)
            ).fetchone()
            raise PermanentProviderError(
                f"host {spec.host} already runs node {holder[0] if holder else '?'}"
            ) from None
        return self._instance(spec.node_id, self._record(spec.node_id))

    async def status(self, node_id: str) -> Instance:
        return self._instance(node_id, self._record(node_id))

    async def delete(self, node_id: str) -> None:
        self._db.execute("DELETE FROM instances WHERE node_id = ?", (node_id,))

    async def reboot(self, node_id: str) -> Instance:
        return await self._restart(node_id, column="boots")

    async def reprovision(self, node_id: str) -> Instance:
        return await self._restart(node_id, column="provisions")

    async def _restart(self, node_id: str, *, column: str) -> Instance:
        assert column in ("boots", "provisions")
        updated = self._db.execute(
            f"UPDATE instances SET booted_at = ?, {column} = {column} + 1 WHERE node_id = ?",
            (time.time(), node_id),
        ).rowcount
        if updated != 1:
            raise PermanentProviderError(f"no node {node_id} to restart")
        return self._instance(node_id, self._record(node_id))

    async def list_instances(self) -> list[Instance]:
        rows = self._db.execute(
            f"SELECT node_id, {', '.join(_COLUMNS)} FROM instances ORDER BY node_id"
        ).fetchall()
        return [self._instance(r[0], dict(zip(_COLUMNS, r[1:], strict=True))) for r in rows]
