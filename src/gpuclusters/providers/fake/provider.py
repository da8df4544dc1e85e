"""In-process fake node provider.

Nodes are records, not machines: a node "boots" for ``boot_delay_s`` and then
runs. The records are kept in a JSON file under the server's home so that
they outlive a server crash exactly like real VMs would, which is what makes
crash tests meaningful: after ``kill -9`` the restarted control plane must
re-adopt these instances, not create them twice, and delete the ones it no
longer knows (orphans).

Hosts named in ``fail_hosts`` make every node placed on them fail, to
exercise failure paths.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
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


@dataclass(slots=True)
class FakeProviderConfig:
    fleet: list[HostSpec]
    state_file: Path
    boot_delay_s: float = 1.0
    fail_hosts: frozenset[str] = field(default_factory=frozenset)


class FakeNodeProvider(NodeProvider):
    name = "fake"

    def __init__(self, config: FakeProviderConfig) -> None:
        self._config = config
        self._hosts = {h.name: h for h in config.fleet}
        self._lock = asyncio.Lock()
        self._records: dict[str, dict[str, Any]] = self._load()

    # -- persistence ---------------------------------------------------------

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._config.state_file.read_text())
        except FileNotFoundError:
            return {}
        return dict(data.get("instances", {}))

    def _save(self) -> None:
        path = self._config.state_file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fake-provider.")
        with os.fdopen(fd, "w") as f:
            json.dump({"instances": self._records}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _instance(self, node_id: str) -> Instance:
        rec = self._records.get(node_id)
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
        async with self._lock:
            if spec.node_id in self._records:
                return self._instance(spec.node_id)
            if spec.host not in self._hosts:
                raise PermanentProviderError(f"unknown host {spec.host!r}")
            taken = [nid for nid, r in self._records.items() if r["host"] == spec.host]
            if taken:
                # One node per host is the control plane's rule too; a second
                # node here means a bug upstream, so refuse loudly.
                raise PermanentProviderError(
                    f"host {spec.host} already runs node {self._records[taken[0]]['name']}"
                )
            self._records[spec.node_id] = {
                "name": spec.name,
                "cluster_id": spec.cluster_id,
                "host": spec.host,
                "compute_class": spec.compute_class,
                "booted_at": time.time(),
                "boots": 1,
                "provisions": 1,
            }
            self._save()
            return self._instance(spec.node_id)

    async def status(self, node_id: str) -> Instance:
        return self._instance(node_id)

    async def delete(self, node_id: str) -> None:
        async with self._lock:
            if self._records.pop(node_id, None) is not None:
                self._save()

    async def reboot(self, node_id: str) -> Instance:
        return await self._restart(node_id, field="boots")

    async def reprovision(self, node_id: str) -> Instance:
        return await self._restart(node_id, field="provisions")

    async def _restart(self, node_id: str, *, field: str) -> Instance:
        async with self._lock:
            rec = self._records.get(node_id)
            if rec is None:
                raise PermanentProviderError(f"no node {node_id} to restart")
            rec["booted_at"] = time.time()
            rec[field] = int(rec.get(field, 0)) + 1
            self._save()
            return self._instance(node_id)

    async def list_instances(self) -> list[Instance]:
        return [self._instance(nid) for nid in sorted(self._records)]
