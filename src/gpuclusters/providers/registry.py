"""The explicit list of node providers, and how each is built from settings.

Adding a provider means adding one entry here; nothing is looked up by name
anywhere else.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuclusters.linux.layout import DEFAULT_NS_DIR
from gpuclusters.providers.base import HostSpec, NodeProvider
from gpuclusters.providers.fake.provider import FakeNodeProvider, FakeProviderConfig
from gpuclusters.providers.fleet import load_fleet
from gpuclusters.providers.hosts.provider import (
    DEFAULT_SEGMENT_MTU,
    EmbeddedFleetProvider,
    HostDirectory,
    HostEndpoint,
    HostsNodeProvider,
)
from gpuclusters.providers.netns.config import NetnsProviderConfig

DEFAULT_FAKE_FLEET = Path(__file__).parent / "fake" / "fleet.yaml"
DEFAULT_NETNS_FLEET = Path(__file__).parent / "netns" / "fleet.yaml"


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """Provider settings, already validated by the server's settings."""

    home: Path
    fleet_file: Path | None = None
    fake_boot_delay_s: float = 1.0
    fake_fail_hosts: frozenset[str] = field(default_factory=frozenset)
    fake_create_delay_s: float = 0.0
    # netns: where mount/UTS namespaces are pinned (None: /run/gpuclusters/ns),
    # and whether GPU nodes start the node agent.
    netns_ns_dir: Path | None = None
    netns_spawn_agent: bool = True
    # Hosts with host agents (netns and hosts providers; docs/hosts.md): the
    # server's view of them, the TLS context it calls them with, this
    # machine's underlay address, the clusters' MTU and the volumes' place.
    host_directory: HostDirectory | None = None
    agent_ssl: ssl.SSLContext | None = None
    underlay_address: str | None = None
    cluster_mtu: int | None = None
    node_share: float = 1.0
    node_userns: bool = False
    node_image: Path | None = None
    volumes_dir: Path | None = None


def _make_fake(opts: ProviderOptions) -> NodeProvider:
    fleet = load_fleet(opts.fleet_file or DEFAULT_FAKE_FLEET)
    return FakeNodeProvider(
        FakeProviderConfig(
            fleet=fleet,
            state_file=opts.home / "fake-provider.sqlite",
            boot_delay_s=opts.fake_boot_delay_s,
            fail_hosts=opts.fake_fail_hosts,
            create_delay_s=opts.fake_create_delay_s,
        )
    )


class _NoHosts:
    """The directory of a provider built without a server (tests, tools)."""

    async def endpoint(self, name: str) -> HostEndpoint | None:
        return None

    async def endpoints(self) -> list[HostEndpoint]:
        return []


def _netns_config(
    opts: ProviderOptions, fleet: list[HostSpec], mtu: int | None
) -> NetnsProviderConfig:
    return NetnsProviderConfig(
        fleet=fleet,
        home=opts.home,
        ns_dir=opts.netns_ns_dir or DEFAULT_NS_DIR,
        spawn_agent=opts.netns_spawn_agent,
        cluster_mtu=mtu,
        volumes_dir=opts.volumes_dir,
        node_share=opts.node_share,
        userns=opts.node_userns,
        image=opts.node_image,
    )


def _make_netns(opts: ProviderOptions) -> NodeProvider:
    """The embedded fleet (this machine), plus any host that joins."""
    return EmbeddedFleetProvider(
        _netns_config(opts, load_fleet(opts.fleet_file or DEFAULT_NETNS_FLEET), opts.cluster_mtu),
        directory=opts.host_directory or _NoHosts(),
        ctx=opts.agent_ssl,
        underlay_address=opts.underlay_address or "127.0.0.1",
    )


def _make_hosts(opts: ProviderOptions) -> NodeProvider:
    """Only hosts with host agents (GPU servers); a fleet file is optional."""
    fleet = load_fleet(opts.fleet_file) if opts.fleet_file else []
    config = _netns_config(opts, fleet, opts.cluster_mtu or DEFAULT_SEGMENT_MTU)
    return HostsNodeProvider(
        config,
        directory=opts.host_directory or _NoHosts(),
        ctx=opts.agent_ssl,
        underlay_address=opts.underlay_address or "127.0.0.1",
    )


PROVIDERS: dict[str, Callable[[ProviderOptions], NodeProvider]] = {
    "fake": _make_fake,
    "netns": _make_netns,
    "hosts": _make_hosts,
}


class UnknownProviderError(ValueError):
    pass


def make_provider(name: str, opts: ProviderOptions) -> NodeProvider:
    try:
        factory = PROVIDERS[name]
    except KeyError:
        raise UnknownProviderError(
            f"unknown provider {name!r}; available: {', '.join(sorted(PROVIDERS))}"
        ) from None
    return factory(opts)
