"""Small fleet files for tests."""

from __future__ import annotations

from pathlib import Path


def four_hosts(path: Path) -> Path:
    """Four H100 hosts in two InfiniBand islands, like the embedded fleet."""
    path.write_text(
        "hosts:\n"
        + "".join(
            f"  - {{name: h{i}, gpu_type: H100_SXM, region: local-1, ib_island: ib-{i // 2}}}\n"
            for i in range(4)
        )
    )
    return path
