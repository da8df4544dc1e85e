"""Settings of the netns provider, and the paths derived from its home.

Under ``$GPUCLUSTERS_HOME``: ``netns-provider.json`` (state), ``nodes/<id>/``
(per-node disks and overlay layers), ``run/`` (bound into every node at
``/run/gpuclusters/control``; the control plane's agent socket lives there) and
``volumes/`` (the shared volumes). Namespaces are pinned in ``ns_dir``
(``/run/gpuclusters/ns``), which is host-wide, like ``/run/netns``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import gpuclusters
from gpuclusters.linux.devices import DeviceSet
from gpuclusters.linux.layout import DEFAULT_NS_DIR
from gpuclusters.providers.base import HostSpec
from gpuclusters.providers.volumes import VolumeStore

# Where scripts/build-k8s (and ``hosts add``, on a GPU host) put the
# Kubernetes binaries nodes run (kubelet, kube-proxy, the control plane), and
# scripts/build-k8s-addons the add-ons' (CoreDNS, metrics-server). A node's
# /var is not the host's (linux/nodebase.py), so these are shared.
NODE_BINARY_CACHES = (
    Path("/var/cache/gpuclusters/k8s"),
    Path("/var/cache/gpuclusters/addons/bin"),
)


def runtime_paths() -> tuple[Path, ...]:
    """Host paths a node must see at the same place, read-only: this Python
    and this package (the node agent runs them), i.e. the base interpreter,
    the virtual environment and the directory the package is imported from;
    and the Kubernetes and add-on binaries."""
    candidates = {
        Path(sys.base_prefix).resolve(),
        Path(sys.prefix).resolve(),
        Path(gpuclusters.__file__).resolve().parent.parent,
    }
    candidates.update(p for p in NODE_BINARY_CACHES if p.is_dir())
    ordered = sorted(candidates, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in ordered:
        if not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class NetnsProviderConfig:
    fleet: list[HostSpec]
    home: Path
    ns_dir: Path = DEFAULT_NS_DIR
    spawn_agent: bool = True
    shares: tuple[Path, ...] = field(default_factory=runtime_paths)
    # The node agent's GPU backend: "simulated" (the embedded fleet's device
    # nodes, whatever GPUs the machine has) or "auto" (NVML where the node
    # sees real GPUs; a host agent on a GPU host).
    gpu_backend: str = "simulated"
    # Where volumes live (None: $home/volumes). A host agent points it at
    # the operator's shared filesystem, the same store every host mounts.
    volumes_dir: Path | None = None
    # The MTU of every cluster network this provider makes (None: the
    # kernel's 1500). Clusters that span hosts carry VXLAN's 50 bytes.
    cluster_mtu: int | None = None
    # The host's real GPU and fabric devices (a host agent on a GPU host):
    # bound into every GPU node instead of simulated device nodes.
    devices: DeviceSet | None = None
    # The share of this host each node may use (linux/nodecgroup.py): its
    # cgroup's limits are this share of the host minus a reserve.
    node_share: float = 1.0
    # GPU nodes in their own user namespaces (linux/userns.py).
    userns: bool = False
    # The root file system nodes boot from (scripts/build-node-image): its
    # top-level directories instead of the host's, its /etc under theirs.
    # None: the host's own directories, read-only.
    image: Path | None = None

    def __post_init__(self) -> None:
        # overlayfs options are comma separated and lowerdir lists are colon
        # separated: such paths cannot be layers.
        if any(c in str(self.home) for c in ",:\\"):
            raise ValueError(f"netns provider: a home with , : or \\ cannot work: {self.home}")

    @property
    def state_file(self) -> Path:
        return self.home / "netns-provider.json"

    @property
    def nodes_dir(self) -> Path:
        return self.home / "nodes"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def volumes(self) -> VolumeStore:
        return VolumeStore(self.volumes_dir or self.home / "volumes")

    @property
    def lock_file(self) -> Path:
        return self.ns_dir.parent / "netns-alloc.lock"
