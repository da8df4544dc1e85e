"""The node-provider contract.

A node is identified by ``node_id``, a stable id the control plane chooses
before it asks for the node. Every method is idempotent on that id, because
the control plane may crash between asking and recording the answer and will
then ask again:

* ``create`` of a node that already exists returns the existing instance
  (it never makes a second one);
* ``delete`` of a missing node is not an error;
* ``status`` of an unknown node answers ``InstanceState.MISSING``, never raises.

Errors: ``ProviderError`` for transient failures (the caller retries later),
``PermanentProviderError`` when retrying cannot help (the node fails).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from gpuclusters.core.idblocks import IdBlock


class ProviderError(Exception):
    """A transient provider failure; retry later."""


class PermanentProviderError(ProviderError):
    """A failure retrying cannot fix (bad host, unsupported GPU type...)."""


class InstanceState(StrEnum):
    BOOTING = "booting"
    RUNNING = "running"
    FAILED = "failed"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One bare-metal host of the fleet inventory."""

    name: str
    gpu_type: str
    region: str
    ib_island: str
    num_gpus: int = 8
    nvme_gib: int = 7680


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Everything a provider needs to make a node."""

    node_id: str
    name: str
    cluster_id: str
    cluster_name: str
    host: str
    gpu_type: str
    compute_class: str
    volume_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # The project's host id block: the node's user namespace maps its ids
    # 0-65535 onto it (core/idblocks.py). None only in tests of providers
    # that do not run user namespaces.
    host_ids: IdBlock | None = None


@dataclass(frozen=True, slots=True)
class Instance:
    node_id: str
    host: str
    state: InstanceState
    message: str = ""


class NodeProvider(ABC):
    """Creates and destroys nodes on the hosts of one fleet."""

    name: ClassVar[str]

    @abstractmethod
    async def hosts(self) -> list[HostSpec]:
        """The fleet inventory this provider can place nodes on."""

    @abstractmethod
    async def create(self, spec: NodeSpec) -> Instance:
        """Start making the node; return at once (state BOOTING) or when done
        (RUNNING). Idempotent on ``spec.node_id``."""

    @abstractmethod
    async def status(self, node_id: str) -> Instance:
        """Current state; ``MISSING`` if the provider has no such node."""

    @abstractmethod
    async def delete(self, node_id: str) -> None:
        """Destroy the node and its local disk; a missing node is not an error."""

    @abstractmethod
    async def reboot(self, node_id: str) -> Instance:
        """Restart the node; local scratch survives."""

    @abstractmethod
    async def reprovision(self, node_id: str) -> Instance:
        """Rebuild the node on the same host from a clean image; local scratch
        is wiped."""

    @abstractmethod
    async def list_instances(self) -> list[Instance]:
        """Every node this provider holds, so the control plane can find and
        remove orphans (nodes it no longer has a record of)."""

    async def close(self) -> None:  # noqa: B027  (optional hook, not abstract)
        """Release resources at shutdown. Nodes keep running."""
