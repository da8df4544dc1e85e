"""``RegistryDaemon.push_new_images``: images that land in the cache while
the server runs (set-up's background builder) are pushed, once each time
the cache changes, and a failed push is tried again at the next look.
The push itself (skopeo into the real registry) is the e2e tests' part."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from gpuclusters.server.registry_daemon import RegistryDaemon, RegistryError
from support.api import make_settings


class CountingDaemon(RegistryDaemon):
    def __init__(self, images: Path, home: Path) -> None:
        settings = make_settings(home, None, images_cache=images)
        super().__init__(settings, keys=None, tls=None)  # type: ignore[arg-type]
        self.pushes: list[list[str]] = []
        self.fail_next = False

    async def push_system_images(self) -> list[str]:
        archives = sorted(p.name for p in self.settings.images_cache.glob("*_*.tar"))
        self.pushes.append(archives)
        if self.fail_next:
            self.fail_next = False
            raise RegistryError("pushing kueue:v1: registry unavailable")
        return archives


async def _until(condition: object, what: str) -> None:
    for _ in range(400):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


async def test_new_archives_are_pushed_once_per_change(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "base_latest.tar").write_bytes(b"a")
    daemon = CountingDaemon(images, tmp_path / "home")
    task = asyncio.create_task(daemon.push_new_images(interval_s=0.02))
    try:
        await asyncio.sleep(0.1)
        assert daemon.pushes == []  # nothing new since the start's own push

        (images / "kueue_v1.tar").write_bytes(b"b")  # the builder finished one
        await _until(lambda: len(daemon.pushes) == 1, "a push")
        assert daemon.pushes[0] == ["base_latest.tar", "kueue_v1.tar"]
        await asyncio.sleep(0.1)
        assert len(daemon.pushes) == 1  # unchanged cache: no more pushes

        daemon.fail_next = True
        (images / "torch_bookworm.tar").write_bytes(b"c")
        await _until(lambda: len(daemon.pushes) == 2, "the failing push")
        assert not task.done()  # a failure does not end the watch
        # Tried again with no further change to the cache, then quiet.
        await _until(lambda: len(daemon.pushes) == 3, "the retry")
        await asyncio.sleep(0.1)
        assert len(daemon.pushes) == 3
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_missing_cache_is_no_error(tmp_path: Path) -> None:
    daemon = CountingDaemon(tmp_path / "nowhere", tmp_path / "home")
    assert daemon._cache_signature() == ()
