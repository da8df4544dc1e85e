"""The host agent's configuration: ``/etc/gpuclusters/host-agent.json``,
written by ``gpuclusters host-agent join`` and read at every start.

Its credentials live in ``<home>/pki`` (mode 0700): the agent's key (made
on this host; only a CSR left it), its certificate (hosts CA), the control
CA it accepts callers from, the server's CA it checks the server with, and
the secret its heartbeats carry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gpuclusters.core.clientconfig import replace_atomically

DEFAULT_CONFIG = Path("/etc/gpuclusters/host-agent.json")
DEFAULT_HOME = Path("/var/lib/gpuclusters-host")
DEFAULT_PORT = 8471


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class AgentConfig:
    name: str
    server_url: str
    # This host's address on the network between hosts: the agent listens
    # there and it is the local end of the clusters' VXLAN segments.
    address: str
    port: int = DEFAULT_PORT
    home: str = str(DEFAULT_HOME)
    ns_dir: str = "/run/gpuclusters/ns"
    # The operator's shared filesystem as this host mounts it (volumes live
    # in <volumes_dir>/<id>); None: volumes on this host's own disk.
    volumes_dir: str | None = None
    # The node image its nodes boot from (a copy of the server's, shipped by
    # `hosts add`; linux/nodeimage.py); None: the host's own directories,
    # read-only.
    node_image: str | None = None
    # A host without NVIDIA GPUs offers this many simulated ones of this type.
    simulated_gpu_type: str = "H100_SXM"
    heartbeat_interval_s: float = 5.0

    @property
    def pki(self) -> Path:
        return Path(self.home) / "pki"

    @property
    def key_file(self) -> Path:
        return self.pki / "agent.key"

    @property
    def cert_file(self) -> Path:
        return self.pki / "agent.crt"

    @property
    def control_ca_file(self) -> Path:
        return self.pki / "control-ca.crt"

    @property
    def server_ca_file(self) -> Path:
        return self.pki / "server-ca.crt"

    @property
    def secret_file(self) -> Path:
        return self.pki / "secret"

    @property
    def run_dir(self) -> Path:
        # Bound into every node at /run/gpuclusters/control: the relay
        # socket its node agent heartbeats to.
        return Path(self.home) / "run"

    def save(self, path: Path) -> None:
        data = json.dumps(asdict(self), indent=1, sort_keys=True).encode() + b"\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, data, mode=0o600)

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        try:
            data: Any = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"{path} does not exist: run `gpuclusters host-agent join` first "
                "(`gpuclusters hosts add` does it for you)"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{path}: unknown settings {', '.join(sorted(unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
