"""Summarise py-spy collapsed stacks (``py-spy record --format raw``).

Prints the frames with the most samples, inclusive (the frame is anywhere on
the stack) and self (the frame is on top), with their share of all samples.
Only frames from our package are counted for the inclusive list, so the
table names our code paths rather than asyncio's machinery.

    .venv/bin/python bench/topframes.py /tmp/profile.txt [--top 15]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    short = path.split("site-packages/")[-1].split("src/")[-1]
    return f"{m.group('func')} ({short})"


def summarise(path: Path, top: int) -> str:
    inclusive: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not count_s.isdigit():
            continue
        n = int(count_s)
        total += n
        frames = [_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_time[frames[-1]] += n
        for f in set(frames):
            if "gpuclusters/" in f:
                inclusive[f] += n
    out = [f"{total} samples", "", "inclusive (our frames):"]
    out += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    out += ["", "self (any frame):"]
    out += [f"  {n / total:6.1%}  {f}" for f, n in self_time.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(summarise(args.profile, args.top))


if __name__ == "__main__":
    main()
