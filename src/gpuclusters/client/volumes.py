"""``client.volumes``: shared volumes of a project.

Volumes only grow (``resize`` to a larger ``size_tib``), and the server refuses
to delete one while a cluster has it bound.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from gpuclusters.client._session import Session, body_of
from gpuclusters.core.models import Volume, VolumeCreate


class VolumesAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(self) -> builtins.list[Volume]:
        return self._s.get_list(self._s.project_path("volumes"), Volume)

    def create(self, spec: VolumeCreate | Mapping[str, Any]) -> Volume:
        return self._s.send(
            "POST", self._s.project_path("volumes"), model=Volume, json=body_of(spec)
        )

    def get(self, name: str) -> Volume:
        return self._s.get(self._s.project_path("volumes", name), model=Volume)

    def resize(self, name: str, size_tib: int) -> Volume:
        """Grow to ``size_tib`` (whole TiB); shrinking is refused by the server."""
        return self._s.send(
            "PATCH",
            self._s.project_path("volumes", name),
            model=Volume,
            json={"size_tib": size_tib},  # a VolumeUpdate; the server validates it
        )

    def delete(self, name: str) -> Volume:
        """Start deleting; the answer has status ``deleting``."""
        return self._s.send("DELETE", self._s.project_path("volumes", name), model=Volume)
