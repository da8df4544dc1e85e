"""Placement of nodes on hosts.

Rules, in order:
1. One live node per host: only hosts with no node and not cordoned are free.
2. A host must have the cluster's GPU type and be in its region.
3. Prefer one InfiniBand island per cluster, so all-reduce traffic never
   crosses islands: first the islands the cluster already uses (most nodes
   first), then an island that can take every remaining node on its own
   (the smallest that fits, to keep big islands whole for big clusters),
   and only then spill over, largest island first, to minimise the number of
   islands used.
4. Ties break by host name, so the answer is deterministic.

If there are not enough free hosts, nothing is placed:
``CapacityUnavailableError`` says what is free.

Rule 3 is ``plan_islands``, which needs only the free hosts per island, so
the server can count them in the database and fetch just the hosts it takes
(``place_nodes`` applies the same plan to a list of hosts in memory).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuclusters.core.errors import CapacityUnavailableError


@dataclass(frozen=True, slots=True)
class HostSlot:
    """What placement needs to know about one host."""

    name: str
    gpu_type: str
    region: str
    ib_island: str
    free: bool


def free_hosts(hosts: Iterable[HostSlot], *, gpu_type: str, region: str) -> list[HostSlot]:
    return sorted(
        (h for h in hosts if h.free and h.gpu_type == gpu_type and h.region == region),
        key=lambda h: h.name,
    )


def place_nodes(
    hosts: Sequence[HostSlot],
    *,
    count: int,
    gpu_type: str,
    region: str,
    used_islands: Iterable[str] = (),
) -> list[HostSlot]:
    """Choose ``count`` free hosts for a cluster (see module docstring)."""
    if count <= 0:
        return []
    candidates = free_hosts(hosts, gpu_type=gpu_type, region=region)
    if len(candidates) < count:
        raise CapacityUnavailableError(
            f"not enough free {gpu_type} hosts in region {region}: need {count} "
            f"node(s) of 8 GPUs, {len(candidates)} free "
            f"({describe_free(hosts)})",
            field="num_gpus",
        )
    by_island: dict[str, list[HostSlot]] = defaultdict(list)
    for h in candidates:
        by_island[h.ib_island].append(h)
    plan = plan_islands({i: len(hs) for i, hs in by_island.items()}, count, used_islands)
    return [h for island, n in plan for h in by_island[island][:n]]


def plan_islands(
    free_by_island: Mapping[str, int], count: int, used_islands: Iterable[str] = ()
) -> list[tuple[str, int]]:
    """How many of ``count`` nodes go to which island (rule 3), given the
    free hosts per island; the caller takes the first hosts by name in each.
    Places fewer than ``count`` only if fewer hosts are free."""
    free = {i: n for i, n in free_by_island.items() if n > 0}
    used = Counter(used_islands)
    order: list[str] = [i for i, _ in sorted(used.items(), key=lambda kv: (-kv[1], kv[0]))]
    remaining = [i for i in free if i not in used]
    if not order:
        fitting = sorted((i for i in remaining if free[i] >= count), key=lambda i: (free[i], i))
        if fitting:
            return [(fitting[0], count)] if count > 0 else []
    order += sorted(remaining, key=lambda i: (-free[i], i))
    plan: list[tuple[str, int]] = []
    left = count
    for island in order:
        take = min(left, free.get(island, 0))
        if take > 0:
            plan.append((island, take))
            left -= take
        if left == 0:
            break
    return plan


def describe_free(hosts: Iterable[HostSlot]) -> str:
    """A one-line summary of all free hosts by GPU type and region, for error
    messages, so the user can see what they could ask for instead."""
    return describe_counts(Counter((h.gpu_type, h.region) for h in hosts if h.free))


def describe_counts(counts: Mapping[tuple[str, str], int]) -> str:
    """``describe_free`` from free host counts by (GPU type, region)."""
    counts = {k: n for k, n in counts.items() if n > 0}
    if not counts:
        return "no hosts are free"
    parts = [f"{n} x {g} in {r}" for (g, r), n in sorted(counts.items())]
    return "free now: " + ", ".join(parts)
