"""Fixtures for tests that make real namespace nodes (root only; skipped
otherwise).

``fleet`` builds providers over a per-test home and remembers every node id
it is asked about; its finalizer deletes them all through a fresh provider
(so it works even if the test broke its own provider object), then checks
that nothing of them is left on the host. A leak fails the test that caused
it, never a later one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nodetools import Fleet, leftovers

_MISSING_TOOLS = [t for t in ("ip", "unshare", "nsenter", "runuser") if not shutil.which(t)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0 and not _MISSING_TOOLS:
        return
    skip = pytest.mark.skip(reason=f"namespace nodes need root and {_MISSING_TOOLS or 'tools'}")
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and "fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(home=tmp_path / "home")
    f.home.mkdir()
    try:
        yield f
    finally:
        homes = [*f.extra_homes, f.home]  # the tmp_path home last: see delete()
        ids = set(f.node_ids)
        for home in homes:
            f.home = home
            cleaner = f.provider()
            ids |= f.recorded_ids()
            for cid in f.cluster_ids:
                await cleaner.delete_service_nodes(cluster_id=cid)
            for node_id in ids:
                await cleaner.delete(node_id)
        left = [x for home in homes for x in leftovers(ids, f.cluster_ids, home)]
        assert not left, f"namespace nodes leaked: {left}"
        for home in f.extra_homes:
            shutil.rmtree(home)
