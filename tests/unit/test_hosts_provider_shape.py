"""The hosts provider is a composition (issue 26): it routes each node to
this machine's netns provider or to a host's agent, and reaches the netns
provider only through its public record interface, never its internals."""

from __future__ import annotations

import inspect
import re

from gpuclusters.providers.hosts import provider as hosts
from gpuclusters.providers.netns.provider import NetnsNodeProvider


def test_the_hosts_provider_is_not_a_netns_provider() -> None:
    assert not issubclass(hosts.HostsNodeProvider, NetnsNodeProvider)
    assert not issubclass(hosts.EmbeddedFleetProvider, NetnsNodeProvider)
    # It is still a provider users' nodes can be reached through (mypy
    # checks the protocol in ``_static_checks``): it defines each method.
    for method in ("shell", "ensure_service_node", "delete_service_nodes", "ensure_gateway"):
        assert method in hosts.HostsNodeProvider.__dict__, method


def test_only_the_netns_providers_public_interface_is_used() -> None:
    source = inspect.getsource(hosts)
    private = re.findall(r"\b(?:_fleet|local)\._[a-z]\w*", source)
    assert private == [], private
    # What it does use exists, public, on the netns provider.
    used = set(re.findall(r"\b(?:self\._fleet|self\.local)\.([a-z]\w*)", source))
    assert used, "the check found no use at all: it cannot fail"
    missing = sorted(u for u in used if not hasattr(NetnsNodeProvider, u))
    assert missing == [], missing
