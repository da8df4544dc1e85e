"""The host's firewall for cluster networks: gateway ports, egress, isolation.

Nodes reach the outside through NAT on the host and users reach clusters
through ports on the host's addresses, so the host routes
(``net.ipv4.ip_forward=1``). Isolation between clusters, and between
clusters and the host, then rests on these iptables rules (docs/access.md):

* ``filter FORWARD`` sends every packet into or out of a cluster bridge
  (``gpcb+``) to ``GPC-FORWARD``: replies pass; a cluster's own bridged
  traffic passes (``br_netfilter`` hands bridged frames to iptables too);
  from a cluster, packets to any other cluster are dropped, and packets to
  anywhere else pass only when the cluster has egress; into a cluster,
  only connections the gateway's DNAT made pass. The rest is dropped.
* ``filter INPUT`` from a cluster bridge (``GPC-INPUT``): replies, ICMP,
  and the ports in ``GPC-NODE-SERVICES`` (the image registry and its token
  endpoint, where the server runs one) only. Nodes have no other business
  with the host's own sockets (databases, the agents' socket is a unix
  socket anyway).
* ``nat PREROUTING`` and ``OUTPUT`` (for connections made on this machine,
  loopback excepted) to a local address go through ``GPC-GATEWAY``: each
  cluster's gateway port is DNATed to its login node's sshd or its
  apiserver. The rules match *any* local address, so a public name that
  resolves to any of the machine's addresses works.
* ``nat POSTROUTING``: a cluster with egress is masqueraded behind the
  host's address on the way out.

Several servers may share a machine, so per-cluster rules live in chains of
their own (``GPCN-``/``GPCP-``/``GPCF-`` + the bridge's suffix), written
whole and atomically with ``iptables-restore --noflush``; the shared chains
hold one jump per cluster, added and removed one by one. Every function is
idempotent.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpuclusters.linux import layout
from gpuclusters.linux.run import CommandError, run

IPTABLES = "iptables"
IPTABLES_RESTORE = "iptables-restore"
BRIDGES = "gpcb+"
IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"

# (table, chain, rule jumping from a built-in chain)
_HOOKS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("filter", "FORWARD", ("-i", BRIDGES, "-j", "GPC-FORWARD")),
    ("filter", "FORWARD", ("-o", BRIDGES, "-j", "GPC-FORWARD")),
    ("filter", "INPUT", ("-i", BRIDGES, "-j", "GPC-INPUT")),
    ("nat", "PREROUTING", ("-m", "addrtype", "--dst-type", "LOCAL", "-j", "GPC-GATEWAY")),
    (
        "nat",
        "OUTPUT",
        ("!", "-d", "127.0.0.0/8", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "GPC-GATEWAY"),
    ),
    ("nat", "POSTROUTING", ("-j", "GPC-POSTROUTING")),
)
# Chains whose content is fixed (rewritten whole) and chains that hold one
# jump per cluster (never flushed: other servers' clusters are there too).
_FIXED = {
    "filter": (
        "GPC-FORWARD",
        [
            # A cluster's own traffic between its nodes is bridged, never
            # routed; br_netfilter still shows it to iptables.
            "-m physdev --physdev-is-bridged -j ACCEPT",
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            "-m conntrack --ctstate INVALID -j DROP",
            f"-i {BRIDGES} -j GPC-FROM-CLUSTERS",
            f"-i {BRIDGES} -o {BRIDGES} -j DROP",
            f"-o {BRIDGES} -m conntrack --ctstate DNAT -j ACCEPT",
            "-j DROP",
        ],
    ),
}
_FIXED_INPUT = (
    "GPC-INPUT",
    [
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        "-p icmp -j ACCEPT",
        "-j GPC-NODE-SERVICES",
        "-j DROP",
    ],
)
# The host's ports nodes may open (the image registry and its token
# endpoint): one rule per port, added and removed by the server that runs
# the service (several servers may share a machine).
NODE_SERVICES = "GPC-NODE-SERVICES"
_SHARED = (
    ("filter", "GPC-FROM-CLUSTERS"),
    ("filter", NODE_SERVICES),
    ("nat", "GPC-GATEWAY"),
    ("nat", "GPC-POSTROUTING"),
)

_lock = asyncio.Lock()


@dataclass(frozen=True, slots=True)
class Forward:
    """One gateway port: TCP ``public_port`` on the host's addresses to
    ``address:port`` on the cluster's network."""

    public_port: int
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class ClusterRules:
    cluster_id: str
    index: int  # the cluster network's index (10.231.<index>.0/24)
    egress: bool
    forwards: tuple[Forward, ...] = ()

    @property
    def suffix(self) -> str:
        return layout.bridge_name(self.cluster_id)[len("gpcb") :]

    @property
    def bridge(self) -> str:
        return layout.bridge_name(self.cluster_id)


def chains(cluster_id: str) -> dict[str, str]:
    """The cluster's own chains, by table role."""
    suffix = layout.bridge_name(cluster_id)[len("gpcb") :]
    return {"dnat": f"GPCN-{suffix}", "snat": f"GPCP-{suffix}", "forward": f"GPCF-{suffix}"}


def shared_jumps(rules: ClusterRules) -> list[tuple[str, str, list[str]]]:
    """``(table, shared chain, rule)`` jumps into the cluster's chains."""
    own = chains(rules.cluster_id)
    subnet = str(layout.subnet(rules.index))
    return [
        ("filter", "GPC-FROM-CLUSTERS", ["-i", rules.bridge, "-g", own["forward"]]),
        ("nat", "GPC-GATEWAY", ["-p", "tcp", "-j", own["dnat"]]),
        ("nat", "GPC-POSTROUTING", ["-s", subnet, "-j", own["snat"]]),
    ]


def render(rules: ClusterRules) -> str:
    """The cluster's chains as ``iptables-restore --noflush`` input: each
    chain is declared (so emptied) and refilled in one commit per table."""
    own = chains(rules.cluster_id)
    nat = [f":{own['dnat']} - [0:0]", f":{own['snat']} - [0:0]"]
    for fwd in rules.forwards:
        nat.append(
            f"-A {own['dnat']} -p tcp --dport {fwd.public_port} "
            f"-j DNAT --to-destination {fwd.address}:{fwd.port}"
        )
    if rules.egress:
        nat.append(f"-A {own['snat']} ! -o {BRIDGES} -j MASQUERADE")
    filt = [
        f":{own['forward']} - [0:0]",
        # Nothing to other clusters, not even through their gateway ports.
        f"-A {own['forward']} -o {BRIDGES} -j DROP",
    ]
    if rules.egress:
        filt.append(f"-A {own['forward']} -j ACCEPT")
    return "\n".join(["*nat", *nat, "COMMIT", "*filter", *filt, "COMMIT", ""])


def render_fixed() -> str:
    lines = ["*filter"]
    for chain, body in (_FIXED["filter"], _FIXED_INPUT):
        lines.append(f":{chain} - [0:0]")
        lines += [f"-A {chain} {rule}" for rule in body]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


async def _ipt(table: str, *args: str, check: bool = True) -> bool:
    try:
        await run([IPTABLES, "-w", "-t", table, *args], timeout_s=20)
    except CommandError:
        if check:
            raise
        return False
    return True


async def _restore(text: str) -> None:
    await run([IPTABLES_RESTORE, "-w", "--noflush"], stdin=text.encode(), timeout_s=20)


async def _ensure_rule(table: str, chain: str, rule: Sequence[str], *, first: bool) -> None:
    if not await _ipt(table, "-C", chain, *rule, check=False):
        if first:
            await _ipt(table, "-I", chain, "1", *rule)
        else:
            await _ipt(table, "-A", chain, *rule)


async def _ensure_chain(table: str, chain: str) -> None:
    if not await _ipt(table, "-n", "-L", chain, check=False):
        await _ipt(table, "-N", chain, check=False)  # another server may have won


async def ensure_base() -> None:
    """Forwarding on, the fixed chains and the hooks from built-in chains."""
    async with _lock:
        for table, chain in _SHARED:
            await _ensure_chain(table, chain)
        await _restore(render_fixed())
        for table, chain, rule in _HOOKS:
            await _ensure_rule(table, chain, rule, first=True)
        await asyncio.to_thread(_enable_forwarding)


def node_service_rule(port: int) -> list[str]:
    return ["-p", "tcp", "--dport", str(port), "-j", "ACCEPT"]


async def open_node_services(ports: Sequence[int]) -> None:
    """Let every cluster's nodes open these TCP ports of the host."""
    await ensure_base()
    async with _lock:
        for port in ports:
            await _ensure_rule("filter", NODE_SERVICES, node_service_rule(port), first=False)


async def close_node_services(ports: Sequence[int]) -> None:
    async with _lock:
        for port in ports:
            while await _ipt("filter", "-D", NODE_SERVICES, *node_service_rule(port), check=False):
                pass


# What ip_forward was before the first server turned it on (kept on /run,
# which a reboot empties as it resets the setting): remove_base puts it back.
FORWARD_BEFORE = "/run/gpuclusters/ip_forward.before"


def _enable_forwarding() -> None:
    with open(IP_FORWARD) as f:
        before = f.read().strip()
    if before == "1":
        return
    os.makedirs(os.path.dirname(FORWARD_BEFORE), exist_ok=True)
    if not os.path.exists(FORWARD_BEFORE):
        with open(FORWARD_BEFORE, "w") as f:
            f.write(before + "\n")
    with open(IP_FORWARD, "w") as f:
        f.write("1\n")


_CLUSTER_CHAIN = re.compile(r"^:(GPC[FNP]-\S+) ", re.M)


async def cluster_chains() -> list[str]:
    """The per-cluster chains on this machine (any server's)."""
    found: list[str] = []
    for table in ("filter", "nat"):
        done = await run(["iptables-save", "-t", table], timeout_s=20)
        found += _CLUSTER_CHAIN.findall(done.stdout.decode())
    return found


async def remove_base() -> bool:
    """Undo :func:`ensure_base` (``gpuclusters down --purge``): the hooks,
    the fixed and shared chains, and ip_forward as it was before. Only when
    no cluster's chains remain (another server's clusters need the base);
    returns whether it was removed."""
    async with _lock:
        if await cluster_chains():
            return False
        for table, chain, rule in _HOOKS:
            while await _ipt(table, "-D", chain, *rule, check=False):
                pass
        for table, chain in (
            ("filter", _FIXED["filter"][0]),
            ("filter", _FIXED_INPUT[0]),
            *_SHARED,
        ):
            if await _ipt(table, "-F", chain, check=False):
                await _ipt(table, "-X", chain, check=False)
        await asyncio.to_thread(_restore_forwarding)
    return True


def _restore_forwarding() -> None:
    try:
        with open(FORWARD_BEFORE) as f:
            before = f.read().strip()
    except FileNotFoundError:
        return
    with open(IP_FORWARD, "w") as f:
        f.write(before + "\n")
    os.unlink(FORWARD_BEFORE)


class PortConflictError(RuntimeError):
    """A gateway port is already forwarded to another cluster on this host."""


def forwarded_ports(nat_rules: str) -> dict[int, str]:
    """Gateway ports in ``iptables -t nat -S`` output, by the cluster chain
    that forwards them."""
    out: dict[int, str] = {}
    for line in nat_rules.splitlines():
        words = line.split()
        if words[:1] == ["-A"] and words[1].startswith("GPCN-") and "--dport" in words:
            out[int(words[words.index("--dport") + 1])] = words[1]
    return out


async def _check_ports(rules: ClusterRules) -> None:
    """Refuse a port another cluster's chain forwards (another server on
    this machine with an overlapping port range): misrouting users to the
    wrong cluster would be far worse than a clear error."""
    if not rules.forwards:
        return
    listed = await run([IPTABLES, "-w", "-t", "nat", "-S"], timeout_s=20)
    own = chains(rules.cluster_id)["dnat"]
    taken = forwarded_ports(listed.stdout.decode())
    clashes = [
        f"{f.public_port} (forwarded by {taken[f.public_port]})"
        for f in rules.forwards
        if taken.get(f.public_port, own) != own
    ]
    if clashes:
        raise PortConflictError(
            f"gateway port(s) {', '.join(clashes)} already forwarded to another cluster on this "
            "host: servers sharing a machine need separate GPUCLUSTERS_GATEWAY_PORTS ranges"
        )


async def apply(rules: ClusterRules) -> None:
    """Write the cluster's chains and make sure the shared chains jump to
    them. Raises ``PortConflictError`` for a port another cluster has."""
    await ensure_base()
    async with _lock:
        await _check_ports(rules)
        await _restore(render(rules))
        for table, chain, rule in shared_jumps(rules):
            await _ensure_rule(table, chain, rule, first=False)


async def remove(cluster_id: str, index: int) -> None:
    """Drop the cluster's jumps and chains (nothing there is fine)."""
    rules = ClusterRules(cluster_id=cluster_id, index=index, egress=False)
    async with _lock:
        for table, chain, rule in shared_jumps(rules):
            while await _ipt(table, "-D", chain, *rule, check=False):
                pass
        own = chains(cluster_id)
        for table, chain in (
            ("nat", own["dnat"]),
            ("nat", own["snat"]),
            ("filter", own["forward"]),
        ):
            if await _ipt(table, "-F", chain, check=False):
                await _ipt(table, "-X", chain, check=False)
