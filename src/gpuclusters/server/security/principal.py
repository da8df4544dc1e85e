"""Who is calling, and what they may do in which project."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuclusters.core.enums import ProjectRole


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: str
    user_name: str
    organization_id: str
    is_admin: bool
    roles: dict[str, ProjectRole] = field(default_factory=dict)  # project id -> role

    def role_in(self, project_id: str) -> ProjectRole | None:
        if self.is_admin:
            return ProjectRole.ADMIN
        return self.roles.get(project_id)
