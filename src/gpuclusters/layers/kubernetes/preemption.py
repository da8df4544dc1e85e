"""The preemption protocol on Kubernetes (see docs/preemptible.md).

T+0 (:func:`preempt`): the node is cordoned (unschedulable, with our
annotation unless a user cordoned it first) and tainted
``gpuclusters.io/preempted=true:NoSchedule``; a Warning event
``PreemptionNotified`` is posted on the Node (``kubectl get events
--field-selector involvedObject.name=NODE`` or a watch sees it); every
workload pod (not DaemonSet-owned, not finished) is evicted through the
Eviction API with its grace period capped at the time left, so its preStop
hook and SIGTERM handler share the budget, as the contract says.

Until the deadline (:func:`preemption_done`): done once no workload pod is
left. Controllers (Jobs, Deployments, ...) recreate their pods elsewhere;
a Job should ignore ``DisruptionTarget`` failures in its podFailurePolicy
(examples/checkpointing/k8s-job.yaml does). An eviction a
PodDisruptionBudget refuses is retried at each step; at the deadline what
is left is deleted with grace 0.

Every step is idempotent: the event has a fixed name (re-applied, not
duplicated) and a repeated eviction only shortens a grace period.
"""

from __future__ import annotations

import contextlib
import math
from datetime import UTC, datetime
from typing import Any

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes import stack
from gpuclusters.layers.kubernetes.api import KubeAPI, NotFound, TooManyRequests

TAINT_KEY = "gpuclusters.io/preempted"
DEFAULT_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds


def capped_grace(pod: dict[str, Any], *, seconds_left: float) -> int:
    """The pod's own grace period, but never past the deadline."""
    own = pod.get("spec", {}).get("terminationGracePeriodSeconds")
    own = DEFAULT_GRACE_S if own is None else int(own)
    return max(0, min(own, math.floor(seconds_left)))


def eviction(pod: dict[str, Any], *, grace_s: int) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "deleteOptions": {"gracePeriodSeconds": grace_s},
    }


def notified_event(
    node: dict[str, Any], *, message: str, now: datetime, deadline: datetime
) -> dict[str, Any]:
    """The Warning event on the Node; one fixed name per node and deadline."""
    name = node["metadata"]["name"]
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{name}.preemption-{int(deadline.timestamp())}",
            "namespace": "default",
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Node",
            "name": name,
            "uid": node["metadata"].get("uid", ""),
        },
        "type": "Warning",
        "reason": "PreemptionNotified",
        "message": message,
        "source": {"component": "gpuclusters"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def running_work(api: KubeAPI, name: str) -> int:
    return len(stack.workload_pods(await api.pods_on(name)))


async def _evict(api: KubeAPI, pod: dict[str, Any], grace_s: int) -> None:
    meta = pod["metadata"]
    # A PodDisruptionBudget says not now, or the pod is gone: the next step looks again.
    with contextlib.suppress(TooManyRequests, NotFound):
        await api.create(
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/eviction",
            eviction(pod, grace_s=grace_s),
        )


async def preempt(
    cp: NodeShell,
    spec: cfg.K8sSpec,
    api: KubeAPI,
    name: str,
    *,
    reason: str,
    deadline: datetime,
) -> None:
    """T+0: cordon, taint, Warning event, evict with capped grace."""
    if not await stack.cordon(api, name, reason=reason):
        return  # Kubernetes does not know the node: nothing runs there
    # kubectl taint merges into the node's taint list (a merge patch would replace it).
    await stack.kubectl(
        cp, spec, "taint", "nodes", name, f"{TAINT_KEY}=true:NoSchedule", "--overwrite"
    )
    now = datetime.now(UTC)
    try:
        node: dict[str, Any] | None = await api.get_node(name)
    except NotFound:
        node = None  # deleted meanwhile: no event to attach
    if node is not None:
        message = (
            f"node {name} is preempted: workloads get SIGTERM now, the node is released "
            f"when they have exited, at {deadline.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} "
            "at the latest"
        )
        await api.apply([notified_event(node, message=message, now=now, deadline=deadline)])
    left = (deadline - now).total_seconds()
    for pod in stack.workload_pods(await api.pods_on(name)):
        await _evict(api, pod, capped_grace(pod, seconds_left=left))


async def preemption_done(api: KubeAPI, name: str, *, deadline: datetime) -> bool:
    try:
        await api.get_node(name)
    except NotFound:
        return True
    pods = stack.workload_pods(await api.pods_on(name))
    if not pods:
        return True
    left = (deadline - datetime.now(UTC)).total_seconds()
    for pod in pods:
        if left > 0:
            if pod["metadata"].get("deletionTimestamp") is None:
                await _evict(api, pod, capped_grace(pod, seconds_left=left))
        else:
            meta = pod["metadata"]
            await api.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0},
            )
    return left <= 0
