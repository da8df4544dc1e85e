"""Summarise py-spy collapsed stacks (``py-spy record --format raw``).

Prints the frames with the most samples, inclusive (the frame is anywhere on
the stack) and self (the frame is on top), with their share of all samples.
Only frames from our package are counted for the inclusive list, so the
table names our code paths rather than asyncio's machinery.

Samples are first split by where the thread was: Python code, SQLite's own
C code (aiosqlite runs each query in a worker thread), a worker waiting for
work, or the event loop's C code. SQLAlchemy's async layer runs queries in
greenlets, which py-spy shows without their caller, so a query's time never
counts towards the Python frame that awaited it: read the SQLite share for
that.

    .venv/bin/python bench/topframes.py /tmp/profile.txt [--top 15]
"""

from __future__ import annotations

import argparse
import linecache
import re
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 50  # bench/control_plane.py records at this rate
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    short = path.split("site-packages/")[-1].split("src/")[-1]
    return f"{m.group('func')} ({short})"


def _source_line(frame: str) -> str:
    """The source text of a raw frame's line, found on ``sys.path`` ("" if
    not found): it tells a worker thread's idle wait from its work."""
    m = _FRAME.match(frame)
    if not m or not m.group("line"):
        return ""
    rel = m.group("file")
    for base in sys.path:
        candidate = Path(base) / rel
        if candidate.is_file():
            return linecache.getline(str(candidate), int(m.group("line"))).strip()
    return ""


def _kind(top: str) -> str:
    """Where a sample was, by its innermost frame: SQLite's own code (C,
    called from aiosqlite's worker thread), a worker waiting for a query
    (idle), the event loop's C code (uvloop: polling, or its own callbacks),
    or Python code."""
    if top.startswith("_connection_worker_thread "):
        return "sqlite (C)" if "function()" in _source_line(top) else "idle"
    if top.startswith("Runner.run ("):
        return "event loop (C: polling or callbacks)"
    return "python"


def summarise(path: Path, top: int) -> str:
    inclusive: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    kind_of: dict[str, str] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not count_s.isdigit():
            continue
        n = int(count_s)
        raw = [f for f in stack.split(";") if f]
        if not raw:
            continue
        total += n
        kind = kind_of.setdefault(raw[-1], _kind(raw[-1]))
        kinds[kind] += n
        if kind != "python":
            continue
        frames = [_name(f) for f in raw]
        self_time[frames[-1]] += n
        for f in set(frames):
            if "gpuclusters/" in f:
                inclusive[f] += n
    py = kinds["python"] or 1
    out = [f"{total} samples ({total / RATE_HZ:.0f} s of thread time at {RATE_HZ} Hz)", ""]
    out += [f"  {n / total:6.1%}  {k}" for k, n in kinds.most_common()]
    out += ["", "inclusive, share of the Python samples (our frames):"]
    out += [f"  {n / py:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    out += ["", "self, share of the Python samples (any frame):"]
    out += [f"  {n / py:6.1%}  {f}" for f, n in self_time.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(summarise(args.profile, args.top))


if __name__ == "__main__":
    main()
