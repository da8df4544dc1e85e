"""Pricing and usage summaries, as pure functions.

A usage record covers one node from the moment it was live (running) to its
release; an open record is counted up to "now". The window a report asks for
clips each record, so reports over adjacent windows add up exactly. Metering
is exact to the second (timestamps, not samples), which is finer than the
contract's "metered every 1-2 minutes".

Rates are per GPU-hour, per GPU type and *billing kind*: ``on_demand``
(standard nodes beyond the project's capacity windows), ``reserved`` and
``pool`` (standard nodes inside them), ``preemptible``. Each kind pays the
type's on-demand rate less that kind's discount, unless the operator's
configuration names a rate for it (``standard`` is accepted for
``on_demand``).
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
ON_DEMAND = "on_demand"


@dataclass(frozen=True, slots=True)
class Interval:
    """One usage record, as pricing sees it."""

    cluster: str
    compute_class: str
    billing: str
    gpu_type: str
    num_gpus: int
    started_at: datetime
    ended_at: datetime | None
    user: str = ""  # who created the cluster (reports by user)


@dataclass(frozen=True, slots=True)
class UsageSum:
    cluster: str
    compute_class: str
    billing: str
    gpu_type: str
    nodes: int
    node_hours: float
    gpu_hours: float
    rate_per_gpu_hour: float
    cost: float


def gpu_hour_rate(
    gpu_type: str,
    billing: str,
    *,
    rates: Mapping[str, Mapping[str, float]],
    discounts: Mapping[str, float],
) -> float:
    """The configured rate for this kind, else the on-demand rate (configured
    or list price) less the kind's discount."""
    configured = rates.get(gpu_type, {})
    if billing in configured:
        return float(configured[billing])
    on_demand = configured.get(ON_DEMAND, configured.get(ComputeClass.STANDARD.value))
    base = float(on_demand if on_demand is not None else DEFAULT_GPU_HOUR_USD.get(gpu_type, 0.0))
    return base * (1.0 - discounts.get(billing, 0.0))


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
    discounts: Mapping[str, float],
) -> list[UsageSum]:
    """GPU-hours and cost per (cluster, class, billing kind, GPU type)."""
    Key = tuple[str, str, str, str]
    hours: dict[Key, float] = defaultdict(float)
    gpu_hours: dict[Key, float] = defaultdict(float)
    nodes: dict[Key, int] = defaultdict(int)
    for iv in intervals:
        h = clipped_hours(iv, since=since, until=until)
        if h <= 0:
            continue
        key = (iv.cluster, iv.compute_class, iv.billing, iv.gpu_type)
        hours[key] += h
        gpu_hours[key] += h * iv.num_gpus
        nodes[key] += 1
    out = []
    for key in sorted(hours):
        cluster, cls, billing, gpu_type = key
        rate = gpu_hour_rate(gpu_type, billing, rates=rates, discounts=discounts)
        out.append(
            UsageSum(
                cluster=cluster,
                compute_class=cls,
                billing=billing,
                gpu_type=gpu_type,
                nodes=nodes[key],
                node_hours=hours[key],
                gpu_hours=gpu_hours[key],
                rate_per_gpu_hour=rate,
                cost=gpu_hours[key] * rate,
            )
        )
    return out
