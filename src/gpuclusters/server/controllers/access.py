"""The access sync: who may log in, pushed to clusters.

sshd on every node reads the allowed accounts' principals and registered
keys from files (``layers/ssh.py``); the Kubernetes API authorizes users
by ClusterRoleBindings (a removed member's binding is deleted, so the
client certificate they hold authorizes nothing). This loop keeps those files equal to
the database: at every ``access_sync_interval_s`` (15 s by default), and at
once when the API says something changed (hint ``access``: an SSH key added
or deleted, a member removed, a user deleted), it computes each usable
cluster's access and asks the cluster's layer to apply it where it differs
from what this process last applied. So a revocation stops new logins
within one interval plus a node round trip, well inside a minute, and a
revocation missed while the server was down is applied at its first pass
(the first pass applies everything: the memory of what was applied starts
empty).

It writes nothing to the database and every application is idempotent, so
two servers may run it side by side.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from sqlalchemy import select

from gpuclusters.core.enums import ClusterStatus
from gpuclusters.layers.base import ClusterRef
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.refs import load_cluster_ref
from gpuclusters.server.db.models import Cluster
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)

_USABLE = (ClusterStatus.READY.value, ClusterStatus.DEGRADED.value)


def digest(ref: ClusterRef) -> str:
    """What the nodes' access files depend on: accounts, their keys, the
    user CA, and the nodes that must have them."""
    h = hashlib.sha256()
    for user in ref.users:
        h.update(f"u {user.name} {user.uid}\n".encode())
    if ref.ssh is not None:
        h.update(f"ca {ref.ssh.user_ca_public_key}\n".encode())
        for account, keys in ref.ssh.authorized_keys:
            h.update(f"a {account} {'|'.join(keys)}\n".encode())
    for node in ref.nodes:
        h.update(f"n {node.node_id}\n".encode())
    return h.hexdigest()


class AccessSync:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.applied: dict[str, str] = {}

    async def pass_once(self) -> int:
        """One look at every usable cluster; returns how many were updated."""
        async with self.rt.sessionmaker() as session:
            clusters = list(
                await session.scalars(
                    select(Cluster).where(Cluster.deleted_at.is_(None), Cluster.status.in_(_USABLE))
                )
            )
            refs = [await load_cluster_ref(session, c, self.rt, ssh=True) for c in clusters]
        live = {r.cluster_id for r in refs}
        for gone in set(self.applied) - live:
            del self.applied[gone]
        updated = 0
        for ref in refs:
            want = digest(ref)
            if self.applied.get(ref.cluster_id) == want:
                continue
            try:
                await self.rt.layer_for(ref.cluster_type).sync_access(ref)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # tried again at the next pass
                log.warning("access sync of cluster %s failed: %s", ref.name, exc)
                continue
            self.applied[ref.cluster_id] = want
            updated += 1
            log.info("access of cluster %s updated (%d accounts)", ref.name, len(ref.users))
        return updated

    async def run(self) -> None:
        """Loop until cancelled. Passes are counted (``Hints.passing``), so
        the API can return a change once a pass after it has pushed it."""
        with self.rt.hints.worker(hints.ACCESS):
            while True:
                with self.rt.hints.passing(hints.ACCESS):
                    try:
                        await self.pass_once()
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        log.exception("access sync failed")
                await self.rt.hints.wait(hints.ACCESS, self.rt.settings.access_sync_interval_s)
