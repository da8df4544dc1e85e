"""The ``netns`` node provider: the embedded fleet, nodes made of Linux
namespaces on the server's own machine (see :mod:`gpuclusters.linux`).

GPU nodes are placed on the hosts of a fleet file (a host is a label here:
every node runs on this machine); service nodes (a cluster's controller and
login machines, asked for by layers through ``NodeAccess``) are the same
kind of node without GPUs or a host. Both sit on their cluster's bridge.

Contract notes (see ``providers.base``):

* ``create`` completes synchronously (tens of milliseconds) and answers
  RUNNING. It is idempotent on the node id: a node that is up is returned
  as is; a recorded node whose namespaces are gone (host reboot, torn down
  by hand) is made again with its disks kept. Nothing is ever recreated
  unasked: ``status`` reports such a node MISSING until the control plane
  asks for it again.
* ``delete`` kills every process of the node, drops its namespaces, veth
  and directories (not the shared volume), and the cluster's bridge with its
  last node. Resources go first and the record last, so an interrupted
  delete is finished by the next one.
* Transient failures (a command failed, a volume not made yet) raise
  ``ProviderError``; requests that can never work (unknown host, taken host,
  bad names) raise ``PermanentProviderError``.

Concurrency: operations on one cluster's nodes are serialised by a
per-cluster lock (they share a bridge and an address range); different
clusters proceed in parallel. A host-wide flock guards the choice of a new
cluster's subnet against other servers on the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import GatewayTarget, NodeAccess, NodeCommandError, NodeShell
from gpuclusters.linux import (
    firewall,
    layout,
    machine,
    network,
    nodecgroup,
    nodeimage,
    userns,
)
from gpuclusters.linux.layout import LayoutError, NodeLayout
from gpuclusters.linux.machine import Daemon, MachineError, NodeBoot
from gpuclusters.linux.procs import ProcessesSurviveError
from gpuclusters.linux.run import CommandError
from gpuclusters.linux.shell import NamespaceShell, close_helpers
from gpuclusters.providers.base import (
    HostSpec,
    Instance,
    InstanceState,
    NodeProvider,
    NodeSpec,
    PermanentProviderError,
    ProviderError,
)
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.state import (
    ClusterNetwork,
    GatewayForward,
    NodeRecord,
    ProviderState,
    StateError,
    host_lock,
)

log = logging.getLogger(__name__)

AGENT = "agent"
AGENT_SOCKET = "/run/gpuclusters/control/agent.sock"
NODE_FILE = "/etc/gpuclusters/node.json"


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """Translate lower-layer failures at the provider boundary."""
    try:
        yield
    except ProviderError:
        raise
    except LayoutError as exc:
        raise PermanentProviderError(f"{what}: {exc}") from exc
    except (
        CommandError,
        MachineError,
        NodeCommandError,
        ProcessesSurviveError,
        StateError,
        OSError,
    ) as exc:
        raise ProviderError(f"{what}: {exc}") from exc


@functools.cache
def _agent_available() -> bool:
    return importlib.util.find_spec("gpuclusters.agent") is not None


class NetnsNodeProvider(NodeProvider):
    name = "netns"

    def __init__(self, config: NetnsProviderConfig) -> None:
        if config.image is not None:
            nodeimage.check(config.image)
            config = dataclasses.replace(
                config,
                shares=tuple(p for p in config.shares if not nodeimage.hidden_by_image(p)),
                # The image's /usr knows no driver: its files go below the
                # node's own driver root (linux/devices.py).
                devices=config.devices.relocated() if config.devices is not None else None,
            )
        self._cfg = config
        if config.userns:
            # Refuse id blocks that meet this host's own ids (accounts,
            # subordinate ranges) before any node runs as them.
            userns.check_host_ids()
        self._hosts = {h.name: h for h in config.fleet}
        self._state: ProviderState | None = None
        self._load_lock = asyncio.Lock()
        self._state_lock = asyncio.Lock()
        self._cluster_locks: dict[str, asyncio.Lock] = {}
        # Firewall rules this process has written, by cluster (skip rewrites).
        self._applied: dict[str, firewall.ClusterRules] = {}
        # Why this host cannot idmap (""), once probed (_check_idmap).
        self._idmap_refusal: str | None = None

    # -- state ---------------------------------------------------------------

    async def _loaded(self) -> ProviderState:
        if self._state is not None:
            return self._state
        async with self._load_lock:
            if self._state is None:
                with _errors("loading netns provider state"):
                    state = await asyncio.to_thread(ProviderState.load, self._cfg.state_file)
                await self._report_missing(state)
                await self._restore_firewall(state)
                self._state = state
        return self._state

    async def _report_missing(self, state: ProviderState) -> None:
        # The start-up reconciliation: say what vanished, change nothing.
        for rec in state.nodes.values():
            if rec.kind == "remote":
                continue
            missing = await self._missing(rec)
            if missing:
                log.warning(
                    "netns node %s (%s) is missing its %s; reported missing until created again",
                    rec.name,
                    rec.node_id,
                    ", ".join(missing),
                )

    async def _restore_firewall(self, state: ProviderState) -> None:
        """Isolation first, then every cluster's gateway and egress rules
        (after a host reboot the kernel has none of them)."""
        with _errors("setting up the host firewall"):
            await firewall.ensure_base()
            for net in state.networks.values():
                if net.vni is not None and net.local is not None:
                    # A host reboot took the segment with the bridge; the
                    # bridge comes back with the cluster's first node.
                    await self._ensure_segment_links(state, net)
                try:
                    await self._apply_rules(net)
                except firewall.PortConflictError as exc:
                    # That cluster's gateway stays closed (its reconcile says
                    # so again); the others, and isolation, must not wait.
                    log.error("cluster %s: %s", net.cluster_id, exc)

    async def _apply_rules(self, net: ClusterNetwork) -> None:
        rules = firewall.ClusterRules(
            cluster_id=net.cluster_id,
            index=net.index,
            egress=net.egress,
            forwards=tuple(
                firewall.Forward(public_port=f.public_port, address=f.address, port=f.port)
                for _, f in sorted(net.forwards.items())
            ),
        )
        if self._applied.get(net.cluster_id) != rules:
            await firewall.apply(rules)
            self._applied[net.cluster_id] = rules

    async def ensure_gateway(
        self, *, cluster_id: str, egress: bool, forwards: Mapping[str, GatewayTarget]
    ) -> None:
        """The cluster's gateway ports and egress, as the firewall rules of
        its network (``linux.firewall``); idempotent. The network must
        exist (a node of the cluster was made)."""
        state = await self._loaded()
        async with self._cluster_lock(cluster_id):
            net = state.networks.get(cluster_id)
            if net is None:
                raise ProviderError(f"cluster {cluster_id} has no network yet")
            wanted = {
                name: GatewayForward(public_port=t.public_port, address=t.address, port=t.port)
                for name, t in forwards.items()
            }
            if net.egress != egress or net.forwards != wanted:
                async with self._state_lock:
                    net.egress = egress
                    net.forwards = wanted
                    await self._save(state)
            try:
                with _errors(f"firewall rules of cluster {cluster_id}"):
                    await self._apply_rules(net)
            except ProviderError as exc:
                if isinstance(exc.__cause__, firewall.PortConflictError):
                    log.error("cluster %s: %s", cluster_id, exc.__cause__)
                raise

    async def ensure_segment(
        self,
        *,
        cluster_id: str,
        index: int | None,
        vni: int,
        local: str,
        peers: set[str],
        mtu: int,
        names: Mapping[str, str],
        egress: bool | None = None,
    ) -> None:
        """Join the cluster's network to its VXLAN segment (a cluster that
        spans hosts; docs/hosts.md): the VNI device on the bridge with one
        forwarding entry per other host, the segment's MTU on the bridge and
        every node here, and the names of the cluster's nodes elsewhere in
        its /etc/hosts. ``index`` is the network the control plane chose (a
        host agent adopts it); None uses this provider's own network of the
        cluster (the server's side). Idempotent."""
        state = await self._loaded()
        async with self._cluster_lock(cluster_id):
            await self._segment(
                state,
                cluster_id=cluster_id,
                index=index,
                vni=vni,
                local=local,
                peers=peers,
                mtu=mtu,
                names=names,
                egress=egress,
            )

    async def _segment(
        self,
        state: ProviderState,
        *,
        cluster_id: str,
        index: int | None,
        vni: int,
        local: str,
        peers: set[str],
        mtu: int,
        names: Mapping[str, str],
        egress: bool | None,
    ) -> None:
        """``ensure_segment`` with the cluster's lock held."""
        with _errors(f"the network of cluster {cluster_id}"):
            layout.check_id(cluster_id, "cluster id")
            if index is None:
                net = await self._network(state, cluster_id)
            else:
                async with self._state_lock:
                    net = state.adopt_network(cluster_id, index)
            wanted = (vni, local, sorted(peers), mtu, dict(names))
            if (net.vni, net.local, net.peers, net.mtu, net.names) != wanted or (
                egress is not None and net.egress != egress
            ):
                async with self._state_lock:
                    net.vni, net.local, net.peers, net.mtu = vni, local, sorted(peers), mtu
                    net.names = dict(names)
                    if egress is not None:
                        net.egress = egress
                    await self._save(state)
            await network.ensure_bridge(cluster_id, net.index, mtu=mtu)
            await self._ensure_segment_links(state, net)
            for rec in state.members(cluster_id):
                if rec.kind != "remote" and network.link_mtu(rec.layout.veth) not in (
                    None,
                    mtu,
                ):
                    await network.ensure_node_mtu(rec.layout, mtu)
            await self._write_names(state, cluster_id)
            await self._apply_rules(net)

    async def _ensure_segment_links(self, state: ProviderState, net: ClusterNetwork) -> None:
        assert net.vni is not None and net.local is not None
        if not network.link_exists(net.bridge):
            return  # made with the cluster's next node (_boot)
        await network.ensure_vxlan(
            net.cluster_id,
            vni=net.vni,
            local=net.local,
            peers=set(net.peers),
            mtu=net.mtu or 1450,
        )

    async def forget_network(self, cluster_id: str) -> None:
        """Drop the cluster's network here if no node of it is left (a host
        agent told that its host left the cluster); idempotent."""
        state = await self._loaded()
        async with self._cluster_lock(cluster_id):
            if cluster_id in state.networks and not state.members(cluster_id):
                await self._forget(state, [], cluster_id)

    async def _save(self, state: ProviderState) -> None:
        with _errors("saving netns provider state"):
            await asyncio.to_thread(state.save, self._cfg.state_file)

    def _cluster_lock(self, cluster_id: str) -> asyncio.Lock:
        return self._cluster_locks.setdefault(cluster_id, asyncio.Lock())

    async def _network(self, state: ProviderState, cluster_id: str) -> ClusterNetwork:
        net = state.networks.get(cluster_id)
        if net is not None:
            return net
        async with host_lock(self._cfg.lock_file):
            taken = await network.host_subnets_in_pool()
            async with self._state_lock:
                net = state.allocate_network(cluster_id, taken=taken)
                if net is None:
                    raise ProviderError("all 256 cluster networks of 10.231.0.0/16 are in use")
                net.mtu = self._cfg.cluster_mtu
                await self._save(state)
            # Made while still holding the host lock: the address on the
            # bridge is what tells other servers the subnet is taken.
            await network.ensure_bridge(cluster_id, net.index, mtu=net.mtu)
        return net

    async def _add_record(self, state: ProviderState, rec: NodeRecord) -> None:
        async with self._state_lock:
            state.nodes[rec.node_id] = rec
            await self._save(state)
            await self._write_names(state, rec.cluster_id)

    def _names_dir(self, cluster_id: str) -> Path:
        return self._cfg.home / "networks" / cluster_id

    async def _write_names(self, state: ProviderState, cluster_id: str) -> None:
        """The cluster network's /etc/hosts (every node and service node) and
        an empty resolv.conf. Rewritten in place, never replaced: nodes see
        the files through bind mounts, which follow the inode."""
        names = {r.hostname: r.address for r in state.members(cluster_id)}
        net = state.networks.get(cluster_id)
        if net is not None:
            # Nodes of the cluster on other hosts (a cluster that spans hosts).
            names = {**net.names, **names}
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{address}\t{hostname}" for hostname, address in sorted(names.items())]
        hosts = "\n".join(lines) + "\n"
        resolv = "# the cluster network has no DNS: names come from /etc/hosts\n"

        def write() -> None:
            d = self._names_dir(cluster_id)
            d.mkdir(parents=True, exist_ok=True)
            for name, text in (("hosts", hosts), ("resolv.conf", resolv)):
                path = d / name
                if not path.exists() or path.read_text() != text:
                    with open(path, "w") as f:  # truncate in place: same inode
                        f.write(text)

        with _errors(f"writing the names of cluster {cluster_id}"):
            await asyncio.to_thread(write)

    async def _forget(self, state: ProviderState, node_ids: list[str], cluster_id: str) -> None:
        """Drop records, and the cluster's network with its last node."""
        async with self._state_lock:
            for node_id in node_ids:
                state.nodes.pop(node_id, None)
            last = not state.members(cluster_id)
            gone = state.networks.pop(cluster_id, None) if last else None
            if gone is not None:
                # Rules first: a crash after this still has the record, so
                # the next delete removes the rules again (idempotent).
                with _errors(f"firewall rules of cluster {cluster_id}"):
                    await firewall.remove(cluster_id, gone.index)
                    await network.delete_vxlan(cluster_id)
                self._applied.pop(cluster_id, None)
            await self._save(state)
            if not last:
                await self._write_names(state, cluster_id)
        if last:
            # The lock object stays: a task may be waiting on it right now.
            await network.delete_bridge(cluster_id)
            await asyncio.to_thread(shutil.rmtree, self._names_dir(cluster_id), True)

    # -- making nodes ---------------------------------------------------------

    def _boot_spec(
        self, rec: NodeRecord, net: ClusterNetwork, shared: Path | None, daemons: tuple[Daemon, ...]
    ) -> NodeBoot:
        host = self._hosts.get(rec.host) if rec.host else None
        info = rec.node_info()
        if rec.kind == "gpu":
            # What orchestrator layers read from /etc/gpuclusters/node.json:
            # the cgroup their node's containers go under (made at boot,
            # removed at power-off) and the host's place in the fabric.
            # In a user namespace the node sees its cgroup as the root.
            info["cgroup_root"] = "/" if rec.host_ids_first else "/" + rec.layout.cgroup_name
            if rec.host_ids_first is not None:
                info["userns"] = True
            if host is not None:
                info["ib_island"] = host.ib_island
                info["nvme_gib"] = host.nvme_gib
            devices = self._cfg.devices
            if devices is not None:
                # The host's devices as the node sees them (node-side paths),
                # for the node agent's device plugin to hand to containers.
                info["devices"] = devices.to_node_info()
        return NodeBoot(
            layout=rec.layout,
            hostname=rec.hostname,
            network_index=net.index,
            address=rec.address,
            run_dir=self._cfg.run_dir,
            gpus=(host.num_gpus if host else 8) if rec.kind == "gpu" else 0,
            shared_dir=shared,
            node_info=info,
            # The control plane's home, and every project's volumes where
            # they live outside it (a node sees its own at /mnt/shared only).
            masks=(self._cfg.home, self._cfg.volumes.root),
            shares=self._cfg.shares,
            daemons=daemons,
            hosts_file=self._names_dir(rec.cluster_id) / "hosts",
            resolv_file=self._names_dir(rec.cluster_id) / "resolv.conf",
            devices=self._cfg.devices if rec.kind == "gpu" else None,
            limits=nodecgroup.this_host_share(self._cfg.node_share),
            host_ids=None if rec.host_ids_first is None else IdBlock(rec.host_ids_first),
            image=self._cfg.image,
        )

    async def _volume_dir(self, volume_id: str | None) -> Path | None:
        if volume_id is None:
            return None
        try:
            data = self._cfg.volumes.path(volume_id) / "data"
        except ValueError as exc:
            raise PermanentProviderError(str(exc)) from exc
        if not await asyncio.to_thread(data.is_dir):
            raise ProviderError(f"volume {volume_id} has no data directory yet ({data})")
        return data

    def _boot_daemons(self, rec: NodeRecord) -> tuple[Daemon, ...]:
        """What a node starts at boot: the node agent, on GPU nodes."""
        if rec.kind != "gpu" or not self._cfg.spawn_agent:
            return ()
        if not _agent_available():
            log.info("gpuclusters.agent is not installed; node %s runs without agent", rec.name)
            return ()
        env = {
            "GPUCLUSTERS_AGENT_NODE_FILE": NODE_FILE,
            "GPUCLUSTERS_AGENT_SOCKET": AGENT_SOCKET,
            # The embedded fleet's GPUs are simulated device nodes, whatever
            # GPUs this host may have; a host agent on a GPU host says "auto".
            "GPUCLUSTERS_AGENT_GPU_BACKEND": self._cfg.gpu_backend,
        }
        return (Daemon(AGENT, (sys.executable, "-m", "gpuclusters.agent"), env),)

    async def _boot(self, state: ProviderState, rec: NodeRecord) -> None:
        net = await self._network(state, rec.cluster_id)
        daemons = self._boot_daemons(rec)
        missing = await self._missing(rec)
        started = False
        if missing:
            shared = await self._volume_dir(rec.volume_id)
            if shared is not None and rec.host_ids_first is not None:
                await asyncio.to_thread(userns.adopt, shared, IdBlock(rec.host_ids_first))
            if "cluster bridge" in missing:
                await network.ensure_bridge(rec.cluster_id, net.index, mtu=net.mtu)
                if net.vni is not None:
                    await self._ensure_segment_links(state, net)
            spec = self._boot_spec(rec, net, shared, daemons)
            # True: the boot helper started the daemons itself.
            started = await machine.boot(spec, bridge=net.bridge)
        if net.mtu is not None and network.link_mtu(rec.layout.veth) != net.mtu:
            await network.ensure_node_mtu(rec.layout, net.mtu)
        if started:
            return
        # Up already: only make sure its daemons run (spawn is idempotent).
        for d in daemons:
            await self._shell(rec).spawn(d.name, d.argv, env=d.env)

    async def _make(self, state: ProviderState, rec: NodeRecord, *, fresh: bool) -> None:
        """Boot a node; a fresh one that fails is removed again entirely."""
        try:
            if rec.host_ids_first is not None:
                await self._check_idmap()
            with _errors(f"making node {rec.name}"):
                await self._boot(state, rec)
        except BaseException:
            if fresh:
                with _errors(f"cleaning up node {rec.name}"):
                    await machine.destroy(rec.layout)
                    await self._forget(state, [rec.node_id], rec.cluster_id)
            raise

    async def _check_idmap(self) -> None:
        """Refuse user-namespace nodes on a host whose file systems cannot
        be idmapped (e.g. an overlayfs root): once per provider, before any
        node is half made. The remedy is the operator's: another root file
        system, or nodes without user namespaces (no security boundary)."""
        if self._idmap_refusal is None:
            shared = [self._cfg.image or Path("/usr"), self._cfg.home, *self._cfg.shares]
            why = await asyncio.to_thread(userns.idmap_refusal, shared)
            self._idmap_refusal = why or ""
        if self._idmap_refusal:
            raise PermanentProviderError(
                f"this host cannot run nodes in user namespaces: {self._idmap_refusal} (its file "
                "systems refuse idmapped mounts; give it a root file system that allows them, "
                "or run the server with GPUCLUSTERS_NODE_USERNS=0, and nodes are then no "
                "security boundary: docs/security.md)"
            )

    def _shell(self, rec: NodeRecord) -> NamespaceShell:
        return NamespaceShell(rec.layout, hostname=rec.hostname, address=rec.address)

    async def _missing(self, rec: NodeRecord) -> list[str]:
        """What of the node is not there; empty when it is up."""
        bridge = layout.bridge_name(rec.cluster_id)
        return await asyncio.to_thread(machine.missing_parts, rec.layout, bridge=bridge)

    async def _instance(self, rec: NodeRecord) -> Instance:
        missing = await self._missing(rec)
        if missing:
            return Instance(
                node_id=rec.node_id,
                host=rec.host or "",
                state=InstanceState.MISSING,
                message=f"node {rec.name} lost its {', '.join(missing)}",
            )
        return Instance(node_id=rec.node_id, host=rec.host or "", state=InstanceState.RUNNING)

    def _validated(self, state: ProviderState, rec: NodeRecord) -> NodeRecord:
        with _errors(f"node {rec.name}"):
            layout.check_id(rec.node_id, "node id")
            layout.check_id(rec.cluster_id, "cluster id")
            layout.check_hostname(rec.hostname)
        clash = state.prefix_clash(rec.node_id)
        if clash is not None:
            raise PermanentProviderError(
                f"node id {rec.node_id} shares its interface names with node {clash.node_id}"
            )
        return rec

    async def _place(self, state: ProviderState, rec: NodeRecord) -> None:
        """Give a new record its address and persist it (before any namespace
        exists: intent first)."""
        await self._network(state, rec.cluster_id)
        async with self._state_lock:
            if not rec.address:
                address = state.allocate_address(rec.cluster_id)
                if address is None:
                    raise PermanentProviderError(f"cluster {rec.cluster_name} has no free address")
                rec.address = address
            elif any(
                r.address == rec.address and r.node_id != rec.node_id
                for r in state.members(rec.cluster_id)
            ):
                raise PermanentProviderError(f"address {rec.address} is taken on this host")
        await self._add_record(state, rec)

    # -- NodeProvider -------------------------------------------------------

    async def hosts(self) -> list[HostSpec]:
        return list(self._cfg.fleet)

    async def create(self, spec: NodeSpec) -> Instance:
        return await self.create_at(spec, address=None)

    async def create_at(self, spec: NodeSpec, *, address: str | None) -> Instance:
        """``create`` at an address the control plane chose (a host agent's
        node of a cluster that spans hosts; its network was set up by
        ``ensure_segment`` first). None: the provider picks the address."""
        state = await self._loaded()
        async with self._cluster_lock(spec.cluster_id):
            rec = state.nodes.get(spec.node_id)
            if rec is not None:
                if rec.kind != "gpu":
                    raise PermanentProviderError(f"{spec.node_id} is a service node")
                # Up: make sure the agent runs. Gone: make it again, disks kept.
                await self._make(state, rec, fresh=False)
                return await self._instance(rec)
            host = self._hosts.get(spec.host)
            if host is None:
                raise PermanentProviderError(f"unknown host {spec.host!r}")
            if host.gpu_type != spec.gpu_type:
                raise PermanentProviderError(
                    f"host {host.name} has {host.gpu_type} GPUs, not {spec.gpu_type}"
                )
            taken = state.node_on_host(spec.host)
            if taken is not None:
                raise PermanentProviderError(f"host {spec.host} already runs node {taken.name}")
            rec = NodeRecord.for_gpu_node(
                spec,
                kind="gpu",
                address=address or "",
                ns_dir=str(self._cfg.ns_dir),
                nodes_dir=str(self._cfg.nodes_dir),
                userns=self._cfg.userns,
            )
            self._validated(state, rec)
            if address is not None and spec.cluster_id not in state.networks:
                raise ProviderError(f"cluster {spec.cluster_id} has no segment on this host yet")
            await self._volume_dir(spec.volume_id)  # fail before allocating anything
            with _errors(f"placing node {spec.name}"):
                await self._place(state, rec)
            await self._make(state, rec, fresh=True)
            return await self._instance(rec)

    async def status(self, node_id: str) -> Instance:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None or rec.kind != "gpu":
            return Instance(node_id=node_id, host="", state=InstanceState.MISSING)
        return await self._instance(rec)

    async def delete(self, node_id: str) -> None:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None:
            await self._delete_unrecorded(node_id)
            return
        async with self._cluster_lock(rec.cluster_id):
            if node_id not in state.nodes:
                return  # deleted while we waited for the lock
            with _errors(f"deleting node {rec.name}"):
                await machine.destroy(rec.layout)
                await self._forget(state, [node_id], rec.cluster_id)

    async def _delete_unrecorded(self, node_id: str) -> None:
        # Everything a node has is named after its id, so the remains of a
        # node whose record was lost (a restored state file) can be found.
        # Only if its directory is in our home, though: another server on
        # this machine may own namespaces of that name.
        try:
            lay = NodeLayout(node_id, self._cfg.ns_dir, self._cfg.nodes_dir)
        except LayoutError:
            return
        if await asyncio.to_thread(lay.dir.exists):
            with _errors(f"deleting remains of node {node_id}"):
                await machine.destroy(lay)

    async def reboot(self, node_id: str) -> Instance:
        return await self._restart(node_id, reprovision=False)

    async def reprovision(self, node_id: str) -> Instance:
        return await self._restart(node_id, reprovision=True)

    async def _restart(self, node_id: str, *, reprovision: bool) -> Instance:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None or rec.kind != "gpu":
            raise PermanentProviderError(f"no node {node_id} to restart")
        async with self._cluster_lock(rec.cluster_id):
            with _errors(f"restarting node {rec.name}"):
                await machine.power_off(rec.layout)
                if reprovision:
                    await machine.wipe(rec.layout)
            await self._make(state, rec, fresh=False)
            return await self._instance(rec)

    async def list_instances(self) -> list[Instance]:
        # GPU nodes only: service nodes have no node row, and listing them
        # would make housekeeping delete them as orphans.
        state = await self._loaded()
        recs = sorted((r for r in state.nodes.values() if r.kind == "gpu"), key=lambda r: r.node_id)
        return [await self._instance(r) for r in recs]

    async def close(self) -> None:
        """Stop the shells' kept helpers; nodes are namespaces and keep running."""
        await close_helpers()

    # -- NodeAccess -----------------------------------------------------------

    async def shell(self, node_id: str) -> NodeShell:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None:
            raise PermanentProviderError(f"no node {node_id}")
        if not await asyncio.to_thread(machine.boot_completed, rec.layout):
            # Never hand out a shell into a half-built node: its mounts may
            # still be the host's, and whatever ran there would write to them.
            raise ProviderError(f"node {rec.name} is not booted")
        return self._shell(rec)

    async def ensure_service_node(
        self,
        *,
        cluster_id: str,
        cluster_name: str,
        role: str,
        volume_id: str | None,
        host_ids: IdBlock | None = None,
    ) -> NodeShell:
        state = await self._loaded()
        async with self._cluster_lock(cluster_id):
            rec = state.service_node(cluster_id, role)
            if rec is not None and rec.volume_id != volume_id:
                # A different volume: reboot the node onto it.
                rec.volume_id = volume_id
                await self._add_record(state, rec)
                with _errors(f"restarting service node {rec.name}"):
                    await machine.power_off(rec.layout)
            if rec is not None:
                await self._make(state, rec, fresh=False)
                return self._shell(rec)
            hostname = f"{cluster_name}-{role}"
            rec = NodeRecord(
                node_id=uuid.uuid4().hex,
                kind="service",
                name=hostname,
                hostname=hostname,
                cluster_id=cluster_id,
                cluster_name=cluster_name,
                role=role,
                volume_id=volume_id,
                address="",
                ns_dir=str(self._cfg.ns_dir),
                nodes_dir=str(self._cfg.nodes_dir),
                host_ids_first=self._service_ids(state, cluster_id, host_ids),
            )
            self._validated(state, rec)
            await self._volume_dir(volume_id)
            with _errors(f"placing service node {hostname}"):
                await self._place(state, rec)
            await self._make(state, rec, fresh=True)
            return self._shell(rec)

    def _service_ids(
        self, state: ProviderState, cluster_id: str, host_ids: IdBlock | None
    ) -> int | None:
        """The first id of a new service node's user namespace: the
        project's block as the caller knows it, or as the cluster's other
        nodes have it. None without user namespaces."""
        if not self._cfg.userns:
            return None
        if host_ids is not None:
            return host_ids.first
        known = {r.host_ids_first for r in state.members(cluster_id)} - {None}
        if len(known) != 1:
            raise ProviderError(f"cluster {cluster_id}: no id block known for its service nodes")
        return known.pop()

    async def delete_service_nodes(self, *, cluster_id: str) -> None:
        state = await self._loaded()
        async with self._cluster_lock(cluster_id):
            recs = [r for r in state.members(cluster_id) if r.kind == "service"]
            if not recs:
                return
            with _errors(f"deleting service nodes of cluster {cluster_id}"):
                for rec in recs:
                    await machine.destroy(rec.layout)
                await self._forget(state, [r.node_id for r in recs], cluster_id)

    # -- for providers that keep their records here ---------------------------
    # A provider of nodes on other machines (hosts with agents) keeps each
    # such node as a ``remote`` record in this provider's state: the address
    # and name come from the cluster's one network, which lives here, and a
    # cluster's records are changed under its lock. These are the only ways
    # in (``providers/hosts/provider.py``).

    def is_local_host(self, name: str) -> bool:
        """Whether ``name`` is a host of this machine's fleet file."""
        return name in self._hosts

    @property
    def userns(self) -> bool:
        return self._cfg.userns

    async def records(self) -> ProviderState:
        """Every record of this machine (loaded once, then kept)."""
        return await self._loaded()

    def cluster_lock(self, cluster_id: str) -> asyncio.Lock:
        """The lock under which a cluster's records and network change."""
        return self._cluster_lock(cluster_id)

    async def add_remote_record(self, state: ProviderState, rec: NodeRecord) -> None:
        """Validate a new ``remote`` record, give it its address on the
        cluster's network and persist it (cluster lock held)."""
        self._validated(state, rec)
        await self._place(state, rec)

    async def forget_records(
        self, state: ProviderState, node_ids: list[str], cluster_id: str
    ) -> None:
        """Drop records, and the cluster's network with its last one
        (cluster lock held)."""
        await self._forget(state, node_ids, cluster_id)

    async def join_segment(
        self,
        state: ProviderState,
        *,
        cluster_id: str,
        vni: int,
        local: str,
        peers: set[str],
        mtu: int,
    ) -> None:
        """This machine's side of the cluster's VXLAN segment, on the
        cluster's own network (cluster lock held; ``ensure_segment``)."""
        await self._segment(
            state,
            cluster_id=cluster_id,
            index=None,
            vni=vni,
            local=local,
            peers=peers,
            mtu=mtu,
            names={},
            egress=None,
        )


def _static_checks(p: NetnsNodeProvider) -> NodeAccess:
    # mypy verifies here that the provider satisfies the NodeAccess protocol.
    return p
