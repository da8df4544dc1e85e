"""``client.alerts``, ``client.repairs`` and ``client.health``: a project's
health alerts, repair records (and their review) and active checks."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from gpuclusters.client._session import Session, body_of
from gpuclusters.core.models import (
    FaultSpec,
    HealthAlert,
    HealthRun,
    HealthRunCreate,
    Node,
    Repair,
    RepairCreate,
)


class AlertsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, include_resolved: bool = False
    ) -> builtins.list[HealthAlert]:
        """Open alerts (newest first); resolved ones too on request."""
        return self._s.get_list(
            self._s.project_path("alerts"),
            HealthAlert,
            params={"cluster": cluster, "include_resolved": True if include_resolved else None},
        )


class RepairsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, state: str | None = None
    ) -> builtins.list[Repair]:
        return self._s.get_list(
            self._s.project_path("repairs"), Repair, params={"cluster": cluster, "state": state}
        )

    def get(self, repair_id: str) -> Repair:
        return self._s.get(self._s.project_path("repairs", repair_id), Repair)

    def create(self, spec: RepairCreate | Mapping[str, Any]) -> Repair:
        """Ask for a repair by hand (project admins); idempotent on its key."""
        return self._s.send(
            "POST", self._s.project_path("repairs"), model=Repair, json=body_of(spec)
        )

    def _review(self, repair_id: str, verdict: str) -> Repair:
        return self._s.send(
            "POST", self._s.project_path("repairs", repair_id, verdict), model=Repair
        )

    def approve(self, repair_id: str) -> Repair:
        return self._review(repair_id, "approve")

    def reject(self, repair_id: str) -> Repair:
        return self._review(repair_id, "reject")

    def cancel(self, repair_id: str) -> Repair:
        return self._review(repair_id, "cancel")


class HealthAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def run(
        self, cluster: str, spec: HealthRunCreate | Mapping[str, Any]
    ) -> builtins.list[HealthRun]:
        """Queue a check on every running node of ``cluster`` (or one node)."""
        return self._s.parse_list(
            self._s.request(
                "POST",
                self._s.project_path("clusters", cluster, "health-checks"),
                json=body_of(spec),
            ),
            HealthRun,
        )

    def list(self, cluster: str | None = None) -> builtins.list[HealthRun]:
        return self._s.get_list(
            self._s.project_path("health-checks"), HealthRun, params={"cluster": cluster}
        )

    def get(self, run_id: str) -> HealthRun:
        return self._s.get(self._s.project_path("health-checks", run_id), HealthRun)

    def inject_fault(self, node: str, spec: FaultSpec | Mapping[str, Any] | None) -> Node:
        """Simulated faults on the embedded fleet (org admins); None clears them."""
        return self._s.send(
            "POST",
            self._s.project_path("nodes", node, "faults"),
            model=Node,
            json=body_of(spec) if spec is not None else None,
        )
