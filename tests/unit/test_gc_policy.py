"""The server process freezes its startup heap (``server/gc_policy.py``).

The claim is about what a full collection walks: the oldest generation.
Before the policy, it holds the whole long-lived heap (the imports alone:
well over 100,000 objects); after the app's startup with ``tune_gc``, the
heap is frozen and the oldest generation holds next to nothing. Each case
runs in its own interpreter, so this test session's heap is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import asyncio, gc, json, sys
sys.path.insert(0, {tests!r})
from support.api import make_settings
from gpuclusters.server.app import create_app

async def main(tune):
    app = create_app(make_settings(__import__("pathlib").Path({home!r}), None), tune_gc=tune)
    async with app.router.lifespan_context(app):
        print(json.dumps({{
            "frozen": gc.get_freeze_count(),
            "oldest": len(gc.get_objects(generation=2)),
            "gen0": gc.get_threshold()[0],
        }}))

asyncio.run(main({tune}))
"""


def _run(tmp_path: Path, tune: bool) -> dict[str, int]:
    tests = str(Path(__file__).resolve().parents[1])
    home = str(tmp_path / ("tuned" if tune else "plain"))
    program = PROGRAM.format(tests=tests, home=home, tune=tune)
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_startup_heap_is_frozen_out_of_full_collections(tmp_path: Path) -> None:
    plain = _run(tmp_path, tune=False)
    assert plain["frozen"] == 0
    assert plain["oldest"] > 100_000  # what every full collection walked
    assert plain["gen0"] == 700

    tuned = _run(tmp_path, tune=True)
    assert tuned["frozen"] > 100_000
    assert tuned["oldest"] < plain["oldest"] // 50
    assert tuned["gen0"] == 7000
