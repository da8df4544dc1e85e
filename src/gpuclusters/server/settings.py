"""All server configuration, in one validated pydantic-settings object.

Read once at start (``Settings()``), from environment variables prefixed
``GPUCLUSTERS_`` and explicit overrides from the command line; nothing else in
the server reads the environment.
"""

from __future__ import annotations

import functools
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuclusters.core import deadlines, idblocks
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.sso import GroupGrant
from gpuclusters.linux import nodeimage


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUCLUSTERS_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".gpuclusters")
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=1, le=65535)
    provider: str = "fake"
    api_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^/\s]+$",
        description="the URL clients reach the API on, written to the admin's config.toml; "
        "with several replicas, the load balancer's (docs/ha.md); default http://HOST:PORT",
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy async URL; SQLite in home when unset"
    )
    region: str = Field(default="local-1", description="default region of new clusters")

    # Fleet and the fake provider.
    fleet_file: Path | None = None
    fake_boot_delay_s: float = Field(default=1.0, ge=0)
    fake_fail_hosts: list[str] = Field(default_factory=list)
    fake_create_delay_s: float = Field(
        default=0.0, ge=0, description="how long the fake provider's create call takes"
    )
    k8s_bin: Path | None = Field(
        default=None,
        description="directory with the Kubernetes and etcd binaries "
        "(default: the scripts/build-k8s cache); must be visible inside nodes",
    )

    # Access from users' machines (docs/access.md).
    public_host: str | None = Field(
        default=None,
        description="the name or address users reach clusters (and the API over TLS) on; "
        "default: this machine's primary address",
    )
    gateway_ports: str = Field(
        default="30000-32767",
        pattern=r"^\d{1,5}-\d{1,5}$",
        description="range of gateway ports given to clusters (SSH and Kubernetes API), "
        "'FIRST-LAST'",
    )
    ssh_cert_validity_h: float = Field(
        default=4.0, gt=0, le=24 * 7, description="validity of SSH user certificates"
    )
    access_sync_interval_s: float = Field(
        default=15.0,
        gt=0,
        le=60,
        description="how often nodes' SSH access (keys, members) is checked against the "
        "database; revocations reach every node within this (plus a node round trip)",
    )
    access_apply_wait_s: float = Field(
        default=20.0,
        ge=0,
        le=120,
        description="how long an API call that changes SSH access (a key added or deleted, "
        "a member added or removed, a user deleted) waits for the access sync to push it to "
        "the clusters before it returns; 0 returns at once",
    )

    # The API over TLS (docs/operators.md "API over TLS"), next to the plain listener on host:port.
    tls: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="serve the API over HTTPS on tls_host:tls_port; auto: when public_host is set",
    )
    tls_host: str = Field(
        default="0.0.0.0", description="address the TLS listener binds (default: every address)"
    )
    tls_port: int = Field(default=8443, ge=1, le=65535)
    tls_cert_file: Path | None = Field(
        default=None,
        description="an operator's server certificate (PEM, chain after it) instead of the "
        "self-signed CA's; needs tls_key_file",
    )
    tls_key_file: Path | None = Field(
        default=None, description="the unencrypted PEM key of tls_cert_file"
    )
    tls_ca_file: Path | None = Field(
        default=None,
        description="with an operator certificate: the CA certificate served at "
        "/v1/tls/ca.pem for users to trust (none: that endpoint answers not_found)",
    )

    @model_validator(mode="after")
    def _tls_files(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        return self

    @model_validator(mode="after")
    def _sso(self) -> Settings:
        if self.sso_issuer is not None:
            if not self.sso_issuer.startswith(("https://", "http://")):
                raise ValueError("sso_issuer: must be an http(s) URL")
            if self.sso_client_secret is None and self.sso_client_secret_file is None:
                raise ValueError("sso_issuer needs sso_client_secret or sso_client_secret_file")
        self.sso_grants  # noqa: B018 (checks the mapping at start)
        return self

    @property
    def sso_enabled(self) -> bool:
        return self.sso_issuer is not None

    @property
    def sso_grants(self) -> list[GroupGrant]:
        grants = []
        for i, item in enumerate(self.sso_group_roles):
            try:
                role = item.get("role")
                grants.append(
                    GroupGrant(
                        group=str(item["group"]),
                        project=item.get("project"),
                        role=ProjectRole(role) if role is not None else None,
                        org_admin=bool(item.get("org_admin", False)),
                    )
                )
            except (KeyError, ValueError) as exc:
                raise ValueError(f"sso_group_roles[{i}]: {exc}") from exc
        return grants

    def sso_secret(self) -> str:
        if self.sso_client_secret_file is not None:
            return self.sso_client_secret_file.read_text().strip()
        return self.sso_client_secret or ""

    @property
    def tls_enabled(self) -> bool:
        """``on``; or ``auto`` with a public host or an operator certificate."""
        if self.tls == "auto":
            return self.public_host is not None or self.tls_cert_file is not None
        return self.tls == "on"

    @property
    def tls_url(self) -> str:
        """The HTTPS URL users reach the API on (gateway_host, tls_port)."""
        host = self.gateway_host
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return f"https://{host}:{self.tls_port}"

    # The image registry (docs/kubernetes.md "Images").
    registry: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="run the image registry on gateway_host:registry_port; auto: when TLS is "
        "on, the provider's nodes run containers (netns, hosts) and the registry binary "
        "(scripts/build-k8s-addons) is present",
    )
    registry_port: int = Field(default=5443, ge=1, le=65535)
    registry_token_port: int = Field(
        default=5444,
        ge=1,
        le=65535,
        description="a TLS listener that answers only the registry's token endpoint, so "
        "nodes reach it without reaching the rest of the API",
    )
    registry_bin: Path = Field(
        default=Path("/var/cache/gpuclusters/addons/bin/registry"),
        description="the CNCF Distribution registry binary",
    )
    registry_dir: Path | None = Field(
        default=None, description="the registry's storage; default: HOME/registry/storage"
    )
    images_cache: Path = Field(
        default=Path("/var/cache/gpuclusters/images"),
        description="the project's own images as OCI archives (scripts/build-images), "
        "pushed into the registry at start",
    )
    registry_system_images: list[str] | None = Field(
        default=None,
        description="which of the cached images to push at start (names without tags); "
        "default: all of them",
    )
    registry_mirrors: dict[str, list[str]] = Field(
        default_factory=dict,
        description='registry mirrors for every node\'s containerd, e.g. {"docker.io": '
        '["https://mirror.example:5000"]} (a pull-through cache); the upstream is tried last',
    )

    @property
    def registry_address(self) -> str:
        """``host:port`` of the registry, as users and nodes name images."""
        host = self.gateway_host
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.registry_port}"

    @property
    def registry_token_url(self) -> str:
        host = self.gateway_host
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{self.registry_token_port}/v1/registry/token"

    @property
    def registry_enabled(self) -> bool:
        if self.registry == "auto":
            # Providers whose nodes run containers: the embedded fleet and hosts.
            return (
                self.tls_enabled
                and self.provider in ("netns", "hosts")
                and self.registry_bin.is_file()
            )
        return self.registry == "on"

    # The metrics database (docs/metrics.md).
    metrics_db: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="run VictoriaMetrics on 127.0.0.1:metrics_db_port, scraping this server "
        "and every node agent; auto: when the provider's nodes run agents (netns, hosts), "
        "the binary (scripts/build-k8s-addons) is present and metrics_url is not set",
    )
    metrics_url: str | None = Field(
        default=None,
        description="a VictoriaMetrics (or Prometheus-compatible) query URL to use instead "
        "of running one, e.g. the one replica that runs it (docs/ha.md)",
    )
    metrics_db_port: int = Field(default=8428, ge=1, le=65535)
    metrics_db_bin: Path = Field(
        default=Path("/var/cache/gpuclusters/addons/bin/victoria-metrics"),
        description="the VictoriaMetrics single-node binary",
    )
    metrics_db_dir: Path | None = Field(
        default=None, description="the metrics database's storage; default: HOME/metrics/data"
    )
    metrics_retention: str = Field(
        default="30d",
        pattern=r"^[0-9]+[hdwy]?$",
        description="how long samples are kept (VictoriaMetrics' -retentionPeriod: 30d, 12w, 1y)",
    )
    metrics_scrape_interval_s: int = Field(
        default=15, ge=1, le=3600, description="how often the server and node agents are scraped"
    )
    metrics_agent_port: int = Field(
        default=9400, ge=1, le=65535, description="the node agents' metrics port (dcgm-exporter's)"
    )
    metrics_alert_port: int = Field(
        default=8880, ge=1, le=65535, description="the rule engine's (vmalert's) port on 127.0.0.1"
    )
    metrics_alert_bin: Path = Field(
        default=Path("/var/cache/gpuclusters/addons/bin/vmalert"),
        description="VictoriaMetrics' rule engine (vmalert), run next to the database",
    )
    metrics_idle_gpu_h: float = Field(
        default=4.0,
        gt=0,
        description="hours a GPU a job or pod holds may show 0 % utilisation before "
        "GpuAllocatedIdle fires",
    )
    metrics_alertmanager_urls: list[str] = Field(
        default_factory=list,
        description="Alertmanagers of the operator's own that the alerts also go to "
        '(JSON list, e.g. ["http://alertmanager:9093"])',
    )
    # --- single sign-on (docs/identity.md) ---------------------------------------
    sso_issuer: str | None = Field(
        default=None,
        description="the identity provider's OpenID Connect issuer URL; unset: no single sign-on",
    )
    sso_client_id: str = Field(default="gpuclusters", description="this server's client id there")
    sso_client_secret: str | None = Field(default=None, description="the client's secret")
    sso_client_secret_file: Path | None = Field(
        default=None, description="a file holding the client's secret (instead of the setting)"
    )
    sso_ca_file: Path | None = Field(
        default=None, description="the CA to verify the provider with (default: the system's)"
    )
    sso_scopes: list[str] = Field(
        default_factory=lambda: ["openid", "profile", "email", "groups", "offline_access"],
        description="scopes asked for; offline_access gives the refresh token sessions need",
    )
    sso_username_claim: str = Field(
        default="preferred_username",
        description="the claim a new user's name comes from (then the email's local part)",
    )
    sso_groups_claim: str = Field(default="groups", description="the claim that lists groups")
    sso_group_roles: list[dict[str, Any]] = Field(
        default_factory=list,
        description='groups to roles (JSON list): [{"group": "ml", "project": "default", '
        '"role": "editor"}, {"group": "ops", "org_admin": true}]',
    )
    sso_recheck_interval_s: float = Field(
        default=120.0,
        gt=0,
        le=240,
        description="how often each session is refreshed at the provider (groups re-applied; "
        "a disabled user locked out); at most 240 s, so a change lands within 5 minutes",
    )
    sso_session_ttl_h: float = Field(
        default=168.0, gt=0, description="a session's whole life; then sign in again"
    )

    @property
    def metrics_db_enabled(self) -> bool:
        if self.metrics_db == "auto":
            return (
                self.metrics_url is None
                and self.provider in ("netns", "hosts")
                and self.metrics_db_bin.is_file()
            )
        return self.metrics_db == "on"

    @property
    def metrics_query_url(self) -> str | None:
        """Where the server asks its PromQL queries (None: no metrics database)."""
        if self.metrics_url is not None:
            return self.metrics_url.rstrip("/")
        if self.metrics_db_enabled:
            return f"http://127.0.0.1:{self.metrics_db_port}"
        return None

    # Controllers.
    reconcile_interval_s: float = Field(default=2.0, gt=0, description="poll period without hints")
    lease_ttl_s: float = Field(default=30.0, gt=0)
    slow_query_ms: float | None = Field(
        default=None, gt=0, description="log every SQL statement slower than this"
    )
    controller_concurrency: int = Field(default=8, ge=1)
    event_retention_h: float = Field(default=72.0, gt=0)
    audit_retention_days: int = Field(
        default=400, ge=1, description="how long the audit log keeps a record (docs/identity.md)"
    )
    housekeeping_interval_s: float = Field(default=60.0, gt=0)
    autoscale_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="how often the autoscaler reads each autoscaled cluster's scheduler "
        "(docs/autoscaling.md)",
    )
    statistics_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="PostgreSQL: how often to look for tables whose planner statistics are "
        "stale, and ANALYZE them (server/db/statistics.py)",
    )
    node_phase_deadlines_s: dict[str, float] = Field(
        default_factory=dict,
        description="seconds a node may stay in a phase, by phase, over the defaults of "
        "core/deadlines.py (0 turns one off); past it the node fails with the reason, or a "
        "release skips the steps that still fail",
    )
    cluster_phase_deadlines_s: dict[str, float] = Field(
        default_factory=dict,
        description="seconds a cluster may stay in a status, by status, over the defaults "
        "of core/deadlines.py (0 turns one off); past it the cluster fails with the "
        "reason, or a delete skips the layer steps that still fail",
    )
    retry_backoff_base_s: float = Field(
        default=1.0, gt=0, description="first wait after a failed controller step (doubles)"
    )
    retry_backoff_cap_s: float = Field(
        default=60.0, gt=0, description="longest wait between attempts of a failing step"
    )
    preemption_grace_s: float = Field(
        default=300.0,
        gt=0,
        description="time a preempted node's workloads get to checkpoint and exit "
        "(the contract's five minutes; shorter in tests)",
    )

    # Hosts with host agents (docs/hosts.md).
    host_agent_timeout_s: float = Field(
        default=30.0, gt=0, description="a host agent silent this long makes its host unreachable"
    )
    underlay_address: str | None = Field(
        default=None,
        description="this machine's address on the network between hosts (its end of the "
        "clusters' VXLAN segments); default: the primary address",
    )
    cluster_mtu: int | None = Field(
        default=None,
        ge=1280,
        le=9000,
        description="MTU of cluster networks; default 1450 (VXLAN over a 1500 underlay) with "
        "the hosts provider, the kernel's 1500 on the embedded fleet",
    )
    id_blocks_start: int = Field(
        default=idblocks.DEFAULT_START,
        description="the first host uid/gid of the projects' id blocks (65536 ids each, one per "
        "project, for their nodes' user namespaces); a multiple of 65536 above every id the "
        "hosts use (docs/security.md)",
    )
    node_userns: bool = Field(
        default=True,
        description="run each node in its own user namespace, mapped onto its project's id "
        "block: root in a node, and in any of its containers, is nobody on the host "
        "(docs/security.md); 0 only for kernels or file systems without idmapped mounts, and "
        "then a node is no security boundary",
    )
    node_image: Path | None = Field(
        default_factory=nodeimage.newest_built,
        description="the root file system embedded-fleet nodes boot from (the directory "
        "scripts/build-node-image prints; default: the newest it built): its /usr, /opt... "
        "instead of the host's, its /etc under theirs; none built and none set, or `none`: the "
        "host's own directories, read-only (docs/security.md)",
    )
    node_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="the share of this machine each embedded-fleet node may use (its cgroup's "
        "CPU, memory and pids limits), after a reserve for the host: 0.25 CPU, 5 percent of memory "
        "(at least 512 MiB), 4096 pids (docs/security.md)",
    )
    volumes_dir: Path | None = Field(
        default=None,
        description="where volumes live on this machine: the operator's shared filesystem "
        "when clusters span hosts (every host mounts it); default: HOME/volumes",
    )

    heartbeat_timeout_s: float = Field(
        default=30.0, gt=0, description="a running node silent this long gets an alert"
    )
    health_thresholds: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='active-check thresholds by GPU type, e.g. {"H100_SXM": '
        '{"nccl_busbw_gbps": 300}} (defaults in agent/checks.py)',
    )
    repair_cooldown_s: float = Field(
        default=1800.0, ge=0, description="no automatic repair of a node this soon after one"
    )
    acceptance_checks: list[str] = Field(
        default_factory=lambda: ["gpu-burn", "nccl"],
        description="active checks a node passes before it counts as running "
        "(skipped ones pass: no GPU here); [] turns acceptance tests off",
    )
    acceptance_burn_s: float = Field(default=300.0, gt=0, description="acceptance GPU burn")
    reservation_warning_h: float = Field(
        default=24.0, gt=0, description="warn this long before a reservation ends"
    )

    # Metering.
    gpu_hour_rates: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='USD per GPU-hour by GPU type and billing kind, e.g. {"H100_SXM": '
        '{"on_demand": 2.5, "preemptible": 1.0}}; unset ones are the on-demand rate '
        "(or the list price in core/pricing.py) less the kind's discount",
    )
    budget_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="how long a project runs on once its budget is spent, before its policy "
        "(pause or stop) applies (docs/budgets.md)",
    )
    preemptible_discount: float = Field(
        default=0.6, ge=0, le=1, description="preemptible discount off the on-demand rate"
    )
    reserved_discount: float = Field(
        default=0.35, ge=0, le=1, description="reserved capacity's discount off on-demand"
    )
    pool_discount: float = Field(
        default=0.2, ge=0, le=1, description="capacity pools' discount off on-demand"
    )

    @property
    def discounts(self) -> dict[str, float]:
        return {
            "on_demand": 0.0,
            "reserved": self.reserved_discount,
            "pool": self.pool_discount,
            "preemptible": self.preemptible_discount,
        }

    @property
    def gateway_port_range(self) -> tuple[int, int]:
        first, last = (int(p) for p in self.gateway_ports.split("-"))
        return first, last

    @field_validator("node_phase_deadlines_s")
    @classmethod
    def _node_deadlines(cls, value: dict[str, float]) -> dict[str, float]:
        return deadlines.merged(deadlines.NODE_PHASE_DEADLINES_S, value, kind="node phase")

    @field_validator("cluster_phase_deadlines_s")
    @classmethod
    def _cluster_deadlines(cls, value: dict[str, float]) -> dict[str, float]:
        return deadlines.merged(deadlines.CLUSTER_PHASE_DEADLINES_S, value, kind="cluster status")

    @field_validator("gateway_ports")
    @classmethod
    def _port_range(cls, v: str) -> str:
        first, last = (int(p) for p in v.split("-"))
        if not 1024 <= first <= last <= 65535:
            raise ValueError("must be FIRST-LAST with 1024 <= FIRST <= LAST <= 65535")
        if last - first < 1:
            raise ValueError("must hold at least two ports")
        return v

    @field_validator("id_blocks_start")
    @classmethod
    def _id_blocks_start(cls, v: int) -> int:
        try:
            idblocks.check_start(v)
        except idblocks.IdBlockError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("node_image", mode="before")
    @classmethod
    def _node_image_none(cls, v: object) -> object:
        # "none": boot nodes from the host's own directories, even where an
        # image was built (the comparison benches; docs/security.md).
        return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v

    @field_validator("node_image")
    @classmethod
    def _node_image(cls, v: Path | None) -> Path | None:
        if v is not None:
            nodeimage.check(v)  # a NodeImageError is a ValueError: pydantic names the field
        return v

    @field_validator("public_host")
    @classmethod
    def _public_host(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        v = v.strip()
        if not re.fullmatch(r"[A-Za-z0-9.:-]{1,253}", v):
            raise ValueError("must be a DNS name or an IP address")
        if v in ("localhost", "0.0.0.0", "::") or v.startswith("127."):
            raise ValueError("must be an address other machines reach (not loopback or a wildcard)")
        return v

    @property
    def gateway_host(self) -> str:
        """``public_host``, or this machine's primary address."""
        return self.public_host or primary_address()

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.home / 'gpuclusters.db'}"

    @property
    def public_url(self) -> str:
        if self.api_url:
            return self.api_url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


@functools.cache
def primary_address() -> str:
    """The address of this machine's default route (no packet is sent: a
    UDP socket's connect only asks the kernel for a route), or the
    hostname's address when there is no default route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            addr = str(s.getsockname()[0])
            if not addr.startswith("127.") and addr != "0.0.0.0":
                return addr
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
