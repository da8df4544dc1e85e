"""The Slurm layer: Slurm (and its accounting) over a cluster's nodes.

Per cluster: a *controller* service node (munged, MariaDB, slurmdbd,
slurmctld in configless mode), a *login* service node (munged and a copy of
slurm.conf, where users land with ``gpuclusters clusters ssh``), and every
GPU node running ``slurmd -Z`` (dynamic registration) with ``gpu:8`` GRES on
its own device nodes. ``/home`` is the shared volume's ``home`` directory on
every node, and every project member has an account (same uid everywhere),
so jobs run as the user and files keep their owner.

The munge key is the cluster's own (32 random bytes), generated once and kept
on the controller; every other node gets it from there, so two clusters never
accept each other's credentials (the end-to-end test checks exactly that).

The steps themselves live in ``stack``; this module only decides which
shells they run on, from the ``ClusterRef`` the control plane passes in.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import datetime

from gpuclusters.core.autoscale import ScaleSignals, SlotState
from gpuclusters.core.enums import GPUS_PER_NODE, ComputeClass
from gpuclusters.core.errors import InvalidStateError
from gpuclusters.core.nodeshell import CommandResult, NodeAccess, NodeShell
from gpuclusters.layers import ssh as sshd
from gpuclusters.layers.accounts import ensure_accounts
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef
from gpuclusters.layers.slurm import config as cfg
from gpuclusters.layers.slurm import preemption, stack
from gpuclusters.layers.slurm.status import active_jobs_on
from gpuclusters.layers.waiting import poll_until

log = logging.getLogger(__name__)

CONTROLLER = "controller"
LOGIN = "login"
MUNGE_KEY_BYTES = 32
CLUSTER_MUNGE_KEY = "/etc/gpuclusters/slurm/munge.key"
# How long a joining node waits for slurmctld before handing its step back.
CONTROLLER_WAIT_S = 20.0
CONTROLLER_POLL_S = 0.1


class SlurmLayer(ClusterLayer):
    def __init__(self, access: NodeAccess) -> None:
        self.access = access

    # -- shells and shared pieces ---------------------------------------------

    async def _service(self, cluster: ClusterRef, role: str) -> NodeShell:
        return await self.access.ensure_service_node(
            cluster_id=cluster.cluster_id,
            cluster_name=cluster.name,
            role=role,
            volume_id=cluster.volume_id,
            host_ids=cluster.host_ids,
        )

    async def _munge_key(self, controller: NodeShell, *, create: bool) -> bytes | None:
        """The cluster's own key, made once (by the control-plane step only,
        so two steps running at once can never make two different keys) and
        kept on the controller at a path of ours. Never /etc/munge/munge.key
        as found: a node's /etc sits over the host's, where the munge package
        leaves its default key, and reading that would give every cluster the
        same key."""
        key = await controller.read_file(CLUSTER_MUNGE_KEY)
        if key is not None and len(key) >= MUNGE_KEY_BYTES:
            return key
        if not create:
            return None
        key = secrets.token_bytes(MUNGE_KEY_BYTES)
        await controller.write_file(CLUSTER_MUNGE_KEY, key, mode=0o400)
        return key

    def _spec(self, cluster: ClusterRef, controller: NodeShell) -> cfg.SlurmSpec:
        auto = cluster.autoscale
        cloud = None
        if auto is not None:
            cloud = cfg.CloudNodes(
                names=auto.slots,
                keep=auto.min_gpus // GPUS_PER_NODE,
                suspend_time_s=auto.idle_s,
                features=(ComputeClass.STANDARD.value,),
            )
        return cfg.SlurmSpec(
            cluster_name=cfg.slurm_cluster_name(cluster.name),
            controller_host=controller.hostname,
            controller_addr=controller.address,
            prolog_script=cluster.slurm_prolog or None,
            epilog_script=cluster.slurm_epilog or None,
            extra_slurm_conf=cluster.slurm_extra_config,
            cloud=cloud,
        )

    async def _prepare(self, shell: NodeShell, cluster: ClusterRef) -> None:
        """/home on the shared volume, and the members' accounts."""
        if cluster.volume_id:
            mounted = await shell.run(["mountpoint", "-q", "/home"], check=False)
            if mounted.returncode != 0:
                await shell.run(["install", "-d", "-m", "0755", "/mnt/shared/home"])
                await shell.run(["mount", "--bind", "/mnt/shared/home", "/home"])
        await ensure_accounts(shell, cluster.users)

    async def _wait_controller(self, controller: NodeShell, *, timeout_s: float) -> bool:
        """Whether slurmctld answers within ``timeout_s``: a joining node
        waits for it here instead of handing its step back and waiting for
        the next reconcile pass."""

        async def answers() -> bool | None:
            return True if await stack.ping(controller) else None

        up = await poll_until(answers, timeout_s=timeout_s, max_delay_s=CONTROLLER_POLL_S)
        return up is not None

    async def prepare_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        """/home on the shared volume and the members' accounts on a GPU node
        (the first part of ``join_node``), for a layer that runs beside this
        one and makes accounts too: homes must land on the shared volume."""
        await self._prepare(await self.access.shell(node.node_id), cluster)

    # -- contract -------------------------------------------------------------

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        controller = await self._service(cluster, CONTROLLER)
        spec = self._spec(cluster, controller)
        key = await self._munge_key(controller, create=True)
        assert key is not None

        async def controller_side() -> None:
            await self._prepare(controller, cluster)
            await stack.start_controller(controller, spec, munge_key=key)

        async def login_side() -> NodeShell:
            # Everything on the login node that does not need slurmctld runs
            # while the controller starts (its daemons take most of the time).
            login = await self._service(cluster, LOGIN)
            await self._prepare(login, cluster)
            await stack.ensure_munge(login, spec, munge_key=key)
            if cluster.ssh is not None:
                # Users' way in: named by the gateway's host in its certificate.
                extra = [cluster.gateway.host] if cluster.gateway else []
                await sshd.ensure_sshd(login, cluster.ssh, extra_names=extra)
            return login

        _, login = await asyncio.gather(controller_side(), login_side())
        await asyncio.gather(
            stack.ensure_admins(controller, [u.name for u in cluster.users if u.admin]),
            stack.start_login(login, spec, munge_key=key),
        )
        return True

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        controller = await self._service(cluster, CONTROLLER)
        spec = self._spec(cluster, controller)
        key = await self._munge_key(controller, create=False)
        if key is None:
            return False  # the control plane step has not started; asked again later
        shell = await self.access.shell(node.node_id)
        # What needs no slurmctld is done while the controller still starts,
        # so slurmd can register the moment slurmctld answers.
        await self._prepare(shell, cluster)
        await stack.ensure_munge(shell, spec, munge_key=key)
        if not await self._wait_controller(controller, timeout_s=CONTROLLER_WAIT_S):
            return False  # the control plane is still coming up; asked again later
        await stack.join_compute(
            controller, shell, spec, munge_key=key, features=[node.compute_class], slot=node.slot
        )
        if cluster.ssh is not None:
            # Reached through the login node, by users with a job here only.
            await sshd.ensure_sshd(shell, cluster.ssh, adopt=True)
        return True

    async def _powered_off(self, controller: NodeShell, node: NodeRef) -> bool:
        """An autoscaled node whose slot Slurm powers down (or has): Slurm
        places nothing there, and a drain would outlive the node (a drained
        slot is never powered up again)."""
        if node.slot is None:
            return False
        current = await stack.get_node(controller, node.slot)
        return current is not None and (current.powered_down or current.powering_down)

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        controller = await self._service(cluster, CONTROLLER)
        if await self._powered_off(controller, node):
            return
        await stack.cordon(controller, node.scheduler_name, reason=reason)

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        """Cordon, requeue the jobs still running there (they restart on other
        nodes; JobRequeue=1), and answer whether the node is empty."""
        controller = await self._service(cluster, CONTROLLER)
        name = node.scheduler_name
        if await self._powered_off(controller, node):
            return not active_jobs_on(await stack.list_jobs(controller), name)
        if await stack.drain(controller, name, reason=reason):
            return True
        for job in active_jobs_on(await stack.list_jobs(controller), name):
            await controller.run(["scontrol", "requeue", str(job.job_id)], check=False)
        return await stack.drain(controller, name, reason=reason)

    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        controller = await self._service(cluster, CONTROLLER)
        return await stack.is_cordoned_by_user(controller, node.scheduler_name)

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        controller = await self._service(cluster, CONTROLLER)
        try:
            shell: NodeShell | None = await self.access.shell(node.node_id)
        except Exception:  # the node is already gone: only slurmctld needs telling
            shell = None
        if node.slot is not None:
            await stack.release_slot(controller, node.slot, node=shell)
        else:
            await stack.remove(controller, node.name, node=shell)
        await preemption.forget(controller, node.scheduler_name)

    async def uncordon(self, cluster: ClusterRef, node: NodeRef) -> None:
        controller = await self._service(cluster, CONTROLLER)
        await stack.uncordon(controller, node.scheduler_name)

    async def run_exclusive(
        self, cluster: ClusterRef, node: NodeRef, argv: list[str], *, timeout_s: float
    ) -> CommandResult | None:
        controller = await self._service(cluster, CONTROLLER)
        shell = await self.access.shell(node.node_id)
        return await stack.run_as_job(
            controller, shell, node.scheduler_name, argv, timeout_s=timeout_s
        )

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        controller = await self._service(cluster, CONTROLLER)
        return await preemption.running_work(controller, node.scheduler_name)

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        controller = await self._service(cluster, CONTROLLER)
        await preemption.preempt(controller, node.scheduler_name, reason=reason, deadline=deadline)

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        controller = await self._service(cluster, CONTROLLER)
        return await preemption.preemption_done(
            controller, node.scheduler_name, reason=reason, deadline=deadline
        )

    async def scale_signals(self, cluster: ClusterRef) -> ScaleSignals | None:
        """Each slot's power state as slurmctld keeps it: asked up (work
        waits), powered or powering down (idle past SuspendTime), busy."""
        if cluster.autoscale is None:
            return None
        controller = await self._service(cluster, CONTROLLER)
        if not await stack.ping(controller):
            return None  # slurmctld restarting: nothing is decided on a partial view
        nodes = {n.name: n for n in await stack.list_nodes(controller)}
        jobs = await stack.list_jobs(controller)
        slots = []
        for name in cluster.autoscale.slots:
            n = nodes.get(name)
            if n is None:
                slots.append(SlotState(name=name, wants_up=False, released=False))
                continue
            slots.append(
                SlotState(
                    name=name,
                    wants_up=n.powering_up,
                    released=n.powered_down or n.powering_down,
                    busy=n.busy or bool(active_jobs_on(jobs, name)),
                )
            )
        # A job Slurm has given the slots to waits in CONFIGURING until they boot.
        pending = tuple(str(j.job_id) for j in jobs if j.state in ("PENDING", "CONFIGURING"))
        return ScaleSignals(slots=tuple(slots), pending_jobs=pending)

    async def delete(self, cluster: ClusterRef) -> None:
        # Compute nodes are released before the cluster is deleted; the service
        # nodes go with every process in them.
        await self.access.delete_service_nodes(cluster_id=cluster.cluster_id)

    async def apply_config(self, cluster: ClusterRef) -> None:
        controller = await self._service(cluster, CONTROLLER)
        login = await self._service(cluster, LOGIN)
        computes = [await self.access.shell(n.node_id) for n in cluster.nodes]
        await stack.apply_config(
            controller, self._spec(cluster, controller), logins=[login], computes=computes
        )

    async def gateway_targets(self, cluster: ClusterRef) -> dict[str, tuple[str, int]]:
        login = await self._service(cluster, LOGIN)
        return {"ssh": (login.address, sshd.SSH_PORT)}

    async def sync_access(self, cluster: ClusterRef) -> None:
        """New keys and members reach the login node and every compute
        node; the accounts they log in as are made first."""
        if cluster.ssh is None:
            return
        shells = [await self._service(cluster, LOGIN)]
        for n in cluster.nodes:
            try:
                shells.append(await self.access.shell(n.node_id))
            except Exception as exc:  # being rebuilt: its join writes the files
                log.debug("node %s has no shell now: %s", n.name, exc)
        access = cluster.ssh

        async def one(shell: NodeShell) -> None:
            await ensure_accounts(shell, cluster.users)
            await sshd.sync_access(shell, access)

        # slurmctld resolves every job's user to sign its credential: a
        # member added after the cluster was made needs an account on the
        # controller too (no sshd there, and no home to make).
        controller = await self._service(cluster, CONTROLLER)
        await asyncio.gather(
            ensure_accounts(controller, cluster.users, create_homes=False),
            *(one(s) for s in shells),
        )

    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        raise InvalidStateError(
            f"cluster {cluster.name}: Kubernetes credentials arrive with the Kubernetes layer"
        )
