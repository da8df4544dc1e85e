"""Pricing and usage summaries, as pure functions.

A usage record covers one node from the moment it was live (running) to its
release; an open record is counted up to "now". The window a report asks for
clips each record, so reports over adjacent windows add up exactly. Metering
is exact to the second (timestamps, not samples), which is finer than the
contract's "metered every 1-2 minutes".

Rates are per GPU-hour, per GPU type and compute class. Standard nodes pay
the type's on-demand rate; preemptible nodes pay it less a flat discount,
unless the operator's configuration names a preemptible rate itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from gpuclusters.core.enums import ComputeClass

# On-demand list prices (USD per GPU-hour) used when the operator sets none.
DEFAULT_GPU_HOUR_USD: dict[str, float] = {
    "H100_SXM": 2.99,
    "H200_SXM": 3.79,
    "B200_SXM": 5.99,
    "A100_SXM": 1.79,
}
DEFAULT_PREEMPTIBLE_DISCOUNT = 0.6  # preemptible pays 40% of on-demand


@dataclass(frozen=True, slots=True)
class Interval:
    """One usage record, as pricing sees it."""

    cluster: str
    compute_class: str
    gpu_type: str
    num_gpus: int
    started_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True, slots=True)
class UsageSum:
    cluster: str
    compute_class: str
    gpu_type: str
    nodes: int
    node_hours: float
    gpu_hours: float
    rate_per_gpu_hour: float
    cost: float


def gpu_hour_rate(
    gpu_type: str,
    compute_class: str,
    *,
    rates: Mapping[str, Mapping[str, float]],
    preemptible_discount: float,
) -> float:
    """The configured rate, else the default on-demand price (less the
    discount for preemptible)."""
    configured = rates.get(gpu_type, {})
    if compute_class in configured:
        return float(configured[compute_class])
    standard = float(
        configured.get(ComputeClass.STANDARD.value, DEFAULT_GPU_HOUR_USD.get(gpu_type, 0.0))
    )
    if compute_class == ComputeClass.PREEMPTIBLE.value:
        return standard * (1.0 - preemptible_discount)
    return standard


def clipped_hours(interval: Interval, *, since: datetime, until: datetime) -> float:
    start = max(interval.started_at, since)
    end = min(interval.ended_at or until, until)
    return max(0.0, (end - start).total_seconds() / 3600.0)


def summarize(
    intervals: Iterable[Interval],
    *,
    since: datetime,
    until: datetime,
    rates: Mapping[str, Mapping[str, float]],
    preemptible_discount: float,
) -> list[UsageSum]:
    """GPU-hours and cost per (cluster, class, GPU type), sorted by name."""
    hours: dict[tuple[str, str, str], float] = defaultdict(float)
    gpu_hours: dict[tuple[str, str, str], float] = defaultdict(float)
    nodes: dict[tuple[str, str, str], int] = defaultdict(int)
    for iv in intervals:
        h = clipped_hours(iv, since=since, until=until)
        if h <= 0:
            continue
        key = (iv.cluster, iv.compute_class, iv.gpu_type)
        hours[key] += h
        gpu_hours[key] += h * iv.num_gpus
        nodes[key] += 1
    out = []
    for key in sorted(hours):
        cluster, cls, gpu_type = key
        rate = gpu_hour_rate(gpu_type, cls, rates=rates, preemptible_discount=preemptible_discount)
        out.append(
            UsageSum(
                cluster=cluster,
                compute_class=cls,
                gpu_type=gpu_type,
                nodes=nodes[key],
                node_hours=hours[key],
                gpu_hours=gpu_hours[key],
                rate_per_gpu_hour=rate,
                cost=gpu_hours[key] * rate,
            )
        )
    return out
