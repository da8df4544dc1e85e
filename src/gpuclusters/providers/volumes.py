"""Shared-volume storage: one directory per volume under a root.

This is the embedded fleet's storage backend (and the fake provider's: a
directory costs nothing). Nodes mount the directory at /mnt/shared. Size is
recorded, not enforced; a real deployment puts the root on a network
filesystem with quotas. Deleting removes the data, so only an explicit
volume delete (never a cluster delete without ``--delete-volume``) calls it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path


class VolumeStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, volume_id: str) -> Path:
        if not volume_id.isalnum():
            raise ValueError(f"bad volume id {volume_id!r}")
        return self.root / volume_id

    async def ensure(self, volume_id: str, *, size_tib: int) -> Path:
        """Create the volume if missing; idempotent."""
        return await asyncio.to_thread(self._ensure, volume_id, size_tib)

    def _ensure(self, volume_id: str, size_tib: int) -> Path:
        p = self.path(volume_id)
        data = p / "data"
        data.mkdir(parents=True, exist_ok=True)
        # Like /tmp: every member can create files, nobody can remove another's.
        data.chmod(0o1777)
        (p / "volume.json").write_text(json.dumps({"id": volume_id, "size_tib": size_tib}))
        return p

    async def exists(self, volume_id: str) -> bool:
        return await asyncio.to_thread(self.path(volume_id).is_dir)

    async def delete(self, volume_id: str) -> None:
        """Remove the volume and its data; a missing volume is not an error."""
        await asyncio.to_thread(shutil.rmtree, self.path(volume_id), True)
