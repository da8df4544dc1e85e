"""Reserved capacity and capacity pools, as pure functions.

A *capacity window* sets GPUs of one type and region aside for one project
for a time: ``reserved`` (prepaid for a period) or ``pool`` (pre-arranged
capacity drawn for scheduled windows). While a window is active:

* other projects' standard nodes may not use the hosts it holds back: the
  window's nodes minus the standard nodes its project already runs there
  (:func:`held_back`);
* unused reserved capacity is still *spare*: preemptible nodes may use it
  and give it back when the project needs it (the usual reclaim);
* the project's standard GPUs are split, cluster by cluster in creation
  order, into reserved, then pool, then on-demand parts (:func:`split`);
  usage above the windows is on-demand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from gpuclusters.core.enums import GPUS_PER_NODE


@dataclass(frozen=True, slots=True)
class Window:
    project: str
    kind: str  # "reserved" | "pool"
    gpu_type: str
    region: str
    num_gpus: int
    start: datetime
    end: datetime

    def active(self, at: datetime) -> bool:
        return self.start <= at < self.end


@dataclass(frozen=True, slots=True)
class Split:
    reserved: int
    pool: int
    on_demand: int


def active_gpus(
    windows: Iterable[Window], *, project: str, gpu_type: str, region: str, at: datetime
) -> dict[str, int]:
    """GPUs of each kind the project holds at ``at``."""
    out = {"reserved": 0, "pool": 0}
    for w in windows:
        if w.project == project and w.gpu_type == gpu_type and w.region == region and w.active(at):
            out[w.kind] = out.get(w.kind, 0) + w.num_gpus
    return out


def held_back(
    windows: Iterable[Window],
    *,
    requester: str,
    gpu_type: str,
    region: str,
    standard_nodes: dict[str, int],
    at: datetime,
) -> int:
    """Hosts of ``gpu_type`` in ``region`` that ``requester``'s standard
    nodes may not take, because other projects' active windows hold them and
    those projects do not use them yet (``standard_nodes``: live standard
    nodes per project of that type and region)."""
    reserved: dict[str, int] = {}
    for w in windows:
        if (
            w.project != requester
            and w.gpu_type == gpu_type
            and w.region == region
            and w.active(at)
        ):
            reserved[w.project] = reserved.get(w.project, 0) + w.num_gpus // GPUS_PER_NODE
    return sum(max(0, n - standard_nodes.get(p, 0)) for p, n in reserved.items())


def split(clusters: Sequence[tuple[str, int]], *, reserved: int, pool: int) -> dict[str, Split]:
    """Split each cluster's standard GPUs (``(name, gpus)`` in creation
    order) into reserved, pool and on-demand parts."""
    out: dict[str, Split] = {}
    for name, gpus in clusters:
        r = min(gpus, reserved)
        reserved -= r
        p = min(gpus - r, pool)
        pool -= p
        out[name] = Split(reserved=r, pool=p, on_demand=gpus - r - p)
    return out


def overbooked(windows: Iterable[Window], new: Window, *, hosts: int) -> int | None:
    """If adding ``new`` would hold back more hosts of its type and region
    than the fleet has at some moment, the most hosts that could still be
    set aside then; None when it fits. Windows are checked at every start
    inside ``new``'s span, where the total can only rise."""
    same = [w for w in windows if w.gpu_type == new.gpu_type and w.region == new.region]
    points = [new.start] + [w.start for w in same if new.start <= w.start < new.end]
    worst = 0
    for t in points:
        worst = max(worst, sum(w.num_gpus for w in same if w.active(t)) // GPUS_PER_NODE)
    if worst + new.num_gpus // GPUS_PER_NODE > hosts:
        return max(0, hosts - worst)
    return None
