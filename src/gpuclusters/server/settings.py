"""All server configuration, in one validated pydantic-settings object.

Read once at start (``Settings()``), from environment variables prefixed
``GPUCLUSTERS_`` and explicit overrides from the command line; nothing else in
the server reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUCLUSTERS_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".gpuclusters")
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=1, le=65535)
    provider: str = "fake"
    database_url: str | None = Field(
        default=None, description="SQLAlchemy async URL; SQLite in home when unset"
    )
    region: str = Field(default="local-1", description="default region of new clusters")

    # Fleet and the fake provider.
    fleet_file: Path | None = None
    fake_boot_delay_s: float = Field(default=1.0, ge=0)
    fake_fail_hosts: list[str] = Field(default_factory=list)
    k8s_bin: Path | None = Field(
        default=None,
        description="directory with the Kubernetes and etcd binaries "
        "(default: the scripts/build-k8s cache); must be visible inside nodes",
    )

    # Controllers.
    reconcile_interval_s: float = Field(default=2.0, gt=0, description="poll period without hints")
    lease_ttl_s: float = Field(default=30.0, gt=0)
    controller_concurrency: int = Field(default=8, ge=1)
    event_retention_h: float = Field(default=72.0, gt=0)
    housekeeping_interval_s: float = Field(default=60.0, gt=0)
    preemption_grace_s: float = Field(
        default=300.0,
        gt=0,
        description="time a preempted node's workloads get to checkpoint and exit "
        "(the contract's five minutes; shorter in tests)",
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
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
