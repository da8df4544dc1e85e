"""The alert rules the metrics database's rule engine (vmalert) evaluates
(docs/metrics.md "Alerts"). Written as data here, rendered to
``HOME/metrics/rules.yml`` at start, so thresholds follow settings.

Every rule on node series keeps the series' ``project_id``, ``cluster`` and
``node_id`` labels: the server's receiver turns a firing alert into an
event on that node (``gpuclusters events``), and the project's users can
read the ``ALERTS`` series of their own projects. Fleet rules (reconcile
lag, unreachable hosts) have no project: they go to the server's log and
to the operator's Alertmanager.

Expressions are MetricsQL (VictoriaMetrics' PromQL): ``bitmap_and`` picks
the thermal bits of NVML's throttle reasons.
"""

from __future__ import annotations

from typing import Any

import yaml

from gpuclusters.core.telemetry import THERMAL_THROTTLE_MASK

# How long a reconciler may go without a full pass before it lags.
RECONCILE_LAG_S = 120


def _alert(
    name: str, expr: str, summary: str, *, severity: str, for_: str | None = None
) -> dict[str, Any]:
    rule: dict[str, Any] = {
        "alert": name,
        "expr": expr,
        "labels": {"severity": severity},
        "annotations": {"summary": summary},
    }
    if for_ is not None:
        rule["for"] = for_
    return rule


def rules(*, interval_s: int, idle_gpu_h: float) -> dict[str, Any]:
    idle_for = f"{round(idle_gpu_h * 60)}m"
    return {
        "groups": [
            {
                "name": "gpuclusters-gpus",
                "interval": f"{interval_s}s",
                "rules": [
                    _alert(
                        "GpuXidError",
                        "DCGM_FI_DEV_XID_ERRORS > 0",
                        "GPU {{ $labels.gpu }} of {{ $labels.node }} reported Xid {{ $value }}",
                        severity="critical",
                    ),
                    _alert(
                        "GpuEccDoubleBit",
                        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0",
                        "GPU {{ $labels.gpu }} of {{ $labels.node }} has {{ $value }} "
                        "double-bit ECC errors",
                        severity="critical",
                    ),
                    _alert(
                        "GpuThermalThrottle",
                        f"bitmap_and(DCGM_FI_DEV_CLOCK_THROTTLE_REASONS, {THERMAL_THROTTLE_MASK})"
                        " > 0",
                        "GPU {{ $labels.gpu }} of {{ $labels.node }} is thermally throttled",
                        severity="warning",
                        for_="1m",
                    ),
                    _alert(
                        "GpuAllocatedIdle",
                        'DCGM_FI_DEV_GPU_UTIL{slurm_job!=""} < 1'
                        ' or DCGM_FI_DEV_GPU_UTIL{pod!=""} < 1',
                        "GPU {{ $labels.gpu }} of {{ $labels.node }} is held "
                        "({{ $labels.slurm_job }}{{ $labels.pod }}) but idle for "
                        f"{idle_for}",
                        severity="warning",
                        for_=idle_for,
                    ),
                    _alert(
                        "NodeAgentDown",
                        'up{job="gpuclusters-nodes"} == 0',
                        "the agent of {{ $labels.node }} does not answer scrapes",
                        severity="critical",
                        for_="1m",
                    ),
                ],
            },
            {
                "name": "gpuclusters-fleet",
                "interval": f"{interval_s}s",
                "rules": [
                    _alert(
                        "HostsUnreachable",
                        'gpuclusters_host_agents{status="unreachable"} > 0',
                        "{{ $value }} host(s) unreachable",
                        severity="critical",
                        for_="1m",
                    ),
                    _alert(
                        "ReconcileLag",
                        "time() - gpuclusters_reconcile_last_full_pass_timestamp_seconds"
                        f" > {RECONCILE_LAG_S}",
                        "the {{ $labels.controller }} reconciler of {{ $labels.instance }} "
                        "has not run a full pass for {{ $value | humanizeDuration }}",
                        severity="warning",
                        for_="2m",
                    ),
                ],
            },
        ]
    }


def render_rules(*, interval_s: int, idle_gpu_h: float) -> str:
    return yaml.safe_dump(rules(interval_s=interval_s, idle_gpu_h=idle_gpu_h), sort_keys=False)
