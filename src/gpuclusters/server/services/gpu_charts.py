"""The console's GPU charts, read from the metrics database: a node's GPUs,
a cluster's nodes, and a workload's GPUs (a Slurm job or a pod) over its
lifetime. Every query goes through ``services.metrics.query``, so a chart
shows the caller's projects' series only, and it is the same on every
replica and after a restart (the database keeps the history).

The answer has the layout uPlot draws (``core.telemetry.series`` has the
same): ``{"t": [...], "gpus": [label, ...], METRIC: [[...], ...]}``, one
column per series, ``None`` where a series has no sample (a gap).
"""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import NotFoundError, ValidationError
from gpuclusters.server.db.models import Cluster, Node
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import metrics, tenancy

# chart metric -> the expression over the series' selector ({SEL})
CHARTS: dict[str, str] = {
    "utilization_pct": "DCGM_FI_DEV_GPU_UTIL{SEL}",
    "memory_used_gib": "DCGM_FI_DEV_FB_USED{SEL} / 1024",
    "temperature_c": "DCGM_FI_DEV_GPU_TEMP{SEL}",
    "power_w": "DCGM_FI_DEV_POWER_USAGE{SEL}",
}
MAX_POINTS = 240


def _selector(labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _label(metric: dict[str, str], by: tuple[str, ...]) -> str:
    if by == ("gpu",):
        return f"GPU {metric.get('gpu', '?')}"
    return " ".join(f"GPU {metric.get(k, '?')}" if k == "gpu" else metric.get(k, "?") for k in by)


def _sort_key(label: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in label.split())


async def chart(
    session: AsyncSession,
    rt: Runtime,
    *,
    principal: Principal,
    project: str,
    labels: dict[str, str],
    start: float,
    end: float,
    by: tuple[str, ...] = ("gpu",),
    mean_by: str | None = None,
) -> dict[str, Any]:
    """The series selected by ``labels`` from ``start`` to ``end``, one line
    per value of ``by`` (or their mean per ``mean_by`` value)."""
    step = max(float(rt.settings.metrics_scrape_interval_s), math.ceil((end - start) / MAX_POINTS))
    selector = _selector(labels)
    answers: dict[str, dict[tuple[str, float], float]] = {}
    keys: set[str] = set()
    stamps: set[float] = set()
    for name, template in CHARTS.items():
        expr = template.replace("{SEL}", selector)
        if mean_by is not None:
            expr = f"avg by ({mean_by}) ({expr})"
        answer = await metrics.query(
            session,
            rt,
            principal=principal,
            kind="query_range",
            params={"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                    "step": f"{step:g}s"},
            project=project,
        )  # fmt: skip
        points: dict[tuple[str, float], float] = {}
        for series in answer.get("data", {}).get("result", []):
            key = _label(series.get("metric", {}), (mean_by,) if mean_by else by)
            keys.add(key)
            for at, value in series.get("values", []):
                stamps.add(float(at))
                points[(key, float(at))] = round(float(value), 2)
        answers[name] = points
    t = sorted(stamps)
    ordered = sorted(keys, key=_sort_key)
    out: dict[str, Any] = {"t": t, "gpus": ordered}
    for name, points in answers.items():
        out[name] = [[points.get((key, at)) for at in t] for key in ordered]
    return out


async def lifetime(
    session: AsyncSession,
    rt: Runtime,
    *,
    principal: Principal,
    project: str,
    labels: dict[str, str],
    lookback: str = "30d",
) -> tuple[float, float] | None:
    """When the selected GPU series were first and last seen (None: never)."""
    selector = _selector(labels)
    bounds = []
    for fn, agg in (("tfirst_over_time", "min"), ("tlast_over_time", "max")):
        answer = await metrics.query(
            session,
            rt,
            principal=principal,
            kind="query",
            params={"query": f"{agg}({fn}(DCGM_FI_DEV_GPU_UTIL{selector}[{lookback}]))",
                    "time": f"{time.time():.3f}"},
            project=project,
        )  # fmt: skip
        result = answer.get("data", {}).get("result", [])
        if not result:
            return None
        bounds.append(float(result[0]["value"][1]))
    return bounds[0], bounds[1]


async def workloads(
    session: AsyncSession,
    rt: Runtime,
    *,
    principal: Principal,
    project: str,
    cluster: str,
    within: str = "1d",
) -> dict[str, list[dict[str, str]]]:
    """The Slurm jobs and pods seen on the cluster's GPUs lately, for links
    to their views."""
    cluster_id, _ = await _ids(session, principal, project, cluster=cluster, node=None)
    out: dict[str, list[dict[str, str]]] = {}
    for kind, by, present in (
        ("jobs", "slurm_job, slurm_user", 'slurm_job!=""'),
        ("pods", "namespace, pod", 'pod!=""'),
    ):
        expr = (
            f"count by ({by}) (last_over_time("
            f'DCGM_FI_DEV_GPU_UTIL{{cluster_id="{_escape(cluster_id)}",{present}}}[{within}]))'
        )
        answer = await metrics.query(
            session, rt, principal=principal, kind="query",
            params={"query": expr, "time": f"{time.time():.3f}"}, project=project,
        )  # fmt: skip
        found = [
            {**r["metric"], "gpus": str(r["value"][1])}
            for r in answer.get("data", {}).get("result", [])
        ]
        if kind == "jobs":
            found.sort(key=lambda m: int(m["slurm_job"]) if m["slurm_job"].isdigit() else 0)
            found.reverse()  # newest first
        else:
            found.sort(key=lambda m: (m.get("namespace", ""), m.get("pod", "")))
        out[kind] = found
    return out


async def _ids(
    session: AsyncSession, principal: Principal, project: str, *, cluster: str, node: str | None
) -> tuple[str, str | None]:
    """The live cluster's id (and its node's), or ``not_found``."""
    found = await tenancy.resolve_project(
        session, principal=principal, name=project, need=ProjectRole.EDITOR
    )
    cluster_id = await session.scalar(
        select(Cluster.id).where(
            Cluster.project_id == found.id, Cluster.name == cluster, Cluster.deleted_at.is_(None)
        )
    )
    if cluster_id is None:
        raise NotFoundError(f"cluster {cluster!r} not found", field="cluster")
    if node is None:
        return cluster_id, None
    node_id = await session.scalar(
        select(Node.id).where(
            Node.cluster_id == cluster_id, Node.name == node, Node.deleted_at.is_(None)
        )
    )
    if node_id is None:
        raise NotFoundError(f"node {node!r} not found", field="node")
    return cluster_id, node_id


async def node_chart(
    session: AsyncSession, rt: Runtime, *, principal: Principal, project: str, cluster: str,
    node: str, window_s: float = 1800,
) -> dict[str, Any]:  # fmt: skip
    """The node's GPUs over the last ``window_s`` seconds."""
    _, node_id = await _ids(session, principal, project, cluster=cluster, node=node)
    assert node_id is not None
    now = time.time()
    return await chart(
        session, rt, principal=principal, project=project, labels={"node_id": node_id},
        start=now - window_s, end=now,
    )  # fmt: skip


async def cluster_chart(
    session: AsyncSession, rt: Runtime, *, principal: Principal, project: str, cluster: str,
    window_s: float = 3600,
) -> dict[str, Any]:  # fmt: skip
    """The cluster's nodes (the mean of each node's GPUs) over the last hour."""
    cluster_id, _ = await _ids(session, principal, project, cluster=cluster, node=None)
    now = time.time()
    return await chart(
        session, rt, principal=principal, project=project, labels={"cluster_id": cluster_id},
        start=now - window_s, end=now, mean_by="node",
    )  # fmt: skip


def workload_labels(cluster_id: str, *, job: str | None, pod: str | None) -> dict[str, str]:
    """The selector of a Slurm job's (``job``) or a pod's (``namespace/name``) GPUs."""
    if job is not None:
        return {"cluster_id": cluster_id, "slurm_job": job}
    namespace, _, name = (pod or "").partition("/")
    if not namespace or not name:
        raise ValidationError("pod: must be NAMESPACE/NAME", field="pod")
    return {"cluster_id": cluster_id, "namespace": namespace, "pod": name}


async def workload_chart(
    session: AsyncSession, rt: Runtime, *, principal: Principal, project: str, cluster: str,
    job: str | None = None, pod: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Exactly the GPUs a Slurm job or pod ran on, over its lifetime (as
    far as the database remembers); one line per node and GPU."""
    cluster_id, _ = await _ids(session, principal, project, cluster=cluster, node=None)
    labels = workload_labels(cluster_id, job=job, pod=pod)
    seen = await lifetime(session, rt, principal=principal, project=project, labels=labels)
    if seen is None:
        return {"t": [], "gpus": [], **{name: [] for name in CHARTS}}
    first, last = seen
    # a little either side, so the start and the end show
    margin = max(float(rt.settings.metrics_scrape_interval_s), (last - first) / 20)
    return await chart(
        session, rt, principal=principal, project=project, labels=labels,
        start=first - margin, end=last + margin, by=("node", "gpu"),
    )  # fmt: skip
