"""The explicit list of node providers, and how each is built from settings.

Adding a provider means adding one entry here; nothing is looked up by name
anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuclusters.linux.layout import DEFAULT_NS_DIR
from gpuclusters.providers.base import NodeProvider
from gpuclusters.providers.fake.provider import FakeNodeProvider, FakeProviderConfig
from gpuclusters.providers.fleet import load_fleet
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider

DEFAULT_FAKE_FLEET = Path(__file__).parent / "fake" / "fleet.yaml"
DEFAULT_NETNS_FLEET = Path(__file__).parent / "netns" / "fleet.yaml"


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """Provider settings, already validated by the server's settings."""

    home: Path
    fleet_file: Path | None = None
    fake_boot_delay_s: float = 1.0
    fake_fail_hosts: frozenset[str] = field(default_factory=frozenset)
    # netns: where mount/UTS namespaces are pinned (None: /run/gpuclusters/ns),
    # and whether GPU nodes start the node agent.
    netns_ns_dir: Path | None = None
    netns_spawn_agent: bool = True


def _make_fake(opts: ProviderOptions) -> NodeProvider:
    fleet = load_fleet(opts.fleet_file or DEFAULT_FAKE_FLEET)
    return FakeNodeProvider(
        FakeProviderConfig(
            fleet=fleet,
            state_file=opts.home / "fake-provider.json",
            boot_delay_s=opts.fake_boot_delay_s,
            fail_hosts=opts.fake_fail_hosts,
        )
    )


def _make_netns(opts: ProviderOptions) -> NodeProvider:
    return NetnsNodeProvider(
        NetnsProviderConfig(
            fleet=load_fleet(opts.fleet_file or DEFAULT_NETNS_FLEET),
            home=opts.home,
            ns_dir=opts.netns_ns_dir or DEFAULT_NS_DIR,
            spawn_agent=opts.netns_spawn_agent,
        )
    )


PROVIDERS: dict[str, Callable[[ProviderOptions], NodeProvider]] = {
    "fake": _make_fake,
    "netns": _make_netns,
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
