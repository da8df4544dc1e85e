"""The explicit list of node providers, and how each is built from settings.

Adding a provider means adding one entry here; nothing is looked up by name
anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuclusters.providers.base import NodeProvider
from gpuclusters.providers.fake.provider import FakeNodeProvider, FakeProviderConfig
from gpuclusters.providers.fleet import load_fleet

DEFAULT_FAKE_FLEET = Path(__file__).parent / "fake" / "fleet.yaml"


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """Provider settings, already validated by the server's settings."""

    home: Path
    fleet_file: Path | None = None
    fake_boot_delay_s: float = 1.0
    fake_fail_hosts: frozenset[str] = field(default_factory=frozenset)


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


PROVIDERS: dict[str, Callable[[ProviderOptions], NodeProvider]] = {
    "fake": _make_fake,
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
