"""Organization-level groups: projects, API keys, users, hosts and the catalog.

These paths are not under ``/v1/projects/{project}``, so they ignore the
client's project; only ``ProjectsAPI.members`` and ``remove_member`` address
a project (the client's, unless one is named).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from gpuclusters.client._session import Session, body_of, quote_name
from gpuclusters.core.models import (
    ApiKeyCreate,
    ApiKeyCreated,
    BudgetSettings,
    Capacity,
    CapacityCreate,
    GpuType,
    Host,
    HostJoinToken,
    Project,
    ProjectBudget,
    ProjectCreate,
    ProjectMember,
    ProjectQuota,
    QuotaLimits,
    Region,
    User,
)
from gpuclusters.core.paging import Page


class ProjectsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[Project]:
        """The caller's projects."""
        return self._s.get_list("/v1/projects", Project)

    def create(self, spec: ProjectCreate | Mapping[str, Any]) -> Project:
        """Org admins only; the caller becomes the project's admin."""
        return self._s.send("POST", "/v1/projects", model=Project, json=body_of(spec))

    def _members_path(self, project: str | None, *parts: str) -> str:
        segments = [quote_name(project or self._s.project), "members"]
        return "/v1/projects/" + "/".join(segments + [quote_name(p) for p in parts])

    def members(self, project: str | None = None) -> builtins.list[ProjectMember]:
        """The members of ``project`` (default: the client's project)."""
        return self._s.get_list(self._members_path(project), ProjectMember)

    def quota(self, project: str | None = None) -> ProjectQuota:
        """The project's quotas and what it holds (any member)."""
        return self._s.get(self._quota_path(project), ProjectQuota)

    def set_quota(
        self, limits: QuotaLimits | Mapping[str, Any], project: str | None = None
    ) -> ProjectQuota:
        """Set every quota of the project (org admins); None is no limit."""
        return self._s.send(
            "PUT", self._quota_path(project), model=ProjectQuota, json=body_of(limits)
        )

    def budget(self, project: str | None = None) -> ProjectBudget:
        """The project's budget, what was spent, and its alerts (any member)."""
        return self._s.get(self._budget_path(project), ProjectBudget)

    def set_budget(
        self, budget: BudgetSettings | Mapping[str, Any], project: str | None = None
    ) -> ProjectBudget:
        """Set the project's budget (org admins)."""
        return self._s.send(
            "PUT", self._budget_path(project), model=ProjectBudget, json=body_of(budget)
        )

    def delete_budget(self, project: str | None = None) -> ProjectBudget:
        return self._s.send("DELETE", self._budget_path(project), model=ProjectBudget)

    def _budget_path(self, project: str | None) -> str:
        return f"/v1/projects/{quote_name(project or self._s.project)}/budget"

    def _quota_path(self, project: str | None) -> str:
        return f"/v1/projects/{quote_name(project or self._s.project)}/quota"

    def remove_member(self, user: str, project: str | None = None) -> ProjectMember:
        """Remove ``user`` from ``project`` (project or org admins); returns the
        removed membership. ``invalid_state`` for the project's last admin."""
        return self._s.send("DELETE", self._members_path(project, user), model=ProjectMember)


class ApiKeysAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def create(self, spec: ApiKeyCreate | Mapping[str, Any]) -> ApiKeyCreated:
        """Issue a key; ``ApiKeyCreated.key`` is the only time the secret is shown."""
        return self._s.send("POST", "/v1/api-keys", model=ApiKeyCreated, json=body_of(spec))


class UsersAPI:
    """The organization's users (org admins only)."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self, *, include_deleted: bool = False) -> builtins.list[User]:
        return self._s.get_list(
            "/v1/users", User, params={"include_deleted": include_deleted or None}
        )

    def delete(self, name: str) -> User:
        """Revoke the user's API keys and SSH keys and remove their memberships;
        their name and uid are never reused. Refuses yourself and the last
        org admin (``invalid_state``)."""
        return self._s.send("DELETE", f"/v1/users/{quote_name(name)}", model=User)


class HostsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[Host]:
        """The whole fleet (org admins only; all pages)."""
        return self._s.get_all("/v1/hosts", Host)

    def page(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Host]:
        """One page of hosts; pass ``next_cursor`` back for the next."""
        return self._s.get_page("/v1/hosts", Host, limit=limit, cursor=cursor)

    def get(self, name: str) -> Host:
        return self._s.get(f"/v1/hosts/{quote_name(name)}", Host)

    def reclaim(self, name: str) -> Host:
        """Take the host back from the preemptible pool (preempting the node
        on it) and cordon it; ``uncordon`` gives it back."""
        return self._s.send("POST", f"/v1/hosts/{name}/reclaim", model=Host)

    def cordon(self, name: str) -> Host:
        """Place nothing new on the host; what runs there stays."""
        return self._s.send("POST", f"/v1/hosts/{name}/cordon", model=Host)

    def uncordon(self, name: str) -> Host:
        return self._s.send("POST", f"/v1/hosts/{name}/uncordon", model=Host)

    def drain(self, name: str) -> Host:
        """Cordon the host and move whatever runs there elsewhere."""
        return self._s.send("POST", f"/v1/hosts/{name}/drain", model=Host)

    def remove(self, name: str, *, force_reason: str | None = None) -> Host:
        """Take an empty host with a host agent out of the fleet;
        ``force_reason``: one gone for good, with the nodes on it (they fail)."""
        return self._s.send(
            "DELETE",
            f"/v1/hosts/{name}",
            model=Host,
            params={"force": True if force_reason is not None else None, "reason": force_reason},
        )

    def join_token(
        self, name: str, *, region: str | None = None, ib_island: str | None = None
    ) -> HostJoinToken:
        """A one-use token for the host agent of ``name`` to join with."""
        body: dict[str, Any] = {"name": name}
        if region is not None:
            body["region"] = region
        if ib_island is not None:
            body["ib_island"] = ib_island
        return self._s.send("POST", "/v1/hosts/join-tokens", model=HostJoinToken, json=body)


class GpuTypesAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[GpuType]:
        return self._s.get_list("/v1/gpu-types", GpuType)


class RegionsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[Region]:
        return self._s.get_list("/v1/regions", Region)


class CapacityAPI:
    """Reservations and capacity pools set aside for projects."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self, project: str | None = None) -> builtins.list[Capacity]:
        """Every project's (org admins) or the caller's projects'."""
        return self._s.get_list("/v1/capacity", Capacity, params={"project": project})

    def create(self, spec: CapacityCreate | Mapping[str, Any]) -> Capacity:
        """Org admins only; ``capacity_unavailable`` if the fleet cannot hold it."""
        return self._s.send("POST", "/v1/capacity", model=Capacity, json=body_of(spec))

    def delete(self, name: str) -> None:
        self._s.request("DELETE", f"/v1/capacity/{name}")
