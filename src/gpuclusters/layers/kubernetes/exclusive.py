"""Exclusive use of a node on Kubernetes, for active health checks.

The check itself needs the node's Python and GPU stack, which the locally
built base image does not carry, so it runs through the node's shell; what
Kubernetes provides is the *scheduling*: a Job whose pod asks for all of the
node's GPUs (``nvidia.com/gpu: 8``) and is pinned to it by its hostname
label. The scheduler starts that pod only once users' GPU pods have left,
and while it holds the GPUs nothing else lands on them. The check runs while
the placeholder runs; the Job is deleted afterwards (and has an
``activeDeadlineSeconds``, so a crash of the control plane cannot leave it
holding the node). A placeholder that does not start within the queue wait
ends the attempt: the node stayed busy.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from gpuclusters.core.enums import GPUS_PER_NODE
from gpuclusters.core.nodeshell import CommandResult
from gpuclusters.layers.base import LayerError
from gpuclusters.layers.kubernetes.api import KubeAPI
from gpuclusters.layers.kubernetes.images import BASE_IMAGE

log = logging.getLogger(__name__)

NAMESPACE = "default"
LABEL = "gpuclusters.io/exclusive-check"


def placeholder_job(name: str, node: str, *, hold_s: int) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {LABEL: "true"}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": hold_s,
            "ttlSecondsAfterFinished": 60,
            "template": {
                "metadata": {"labels": {LABEL: "true"}},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        {
                            "name": "hold",
                            "image": BASE_IMAGE,
                            "command": ["sleep", str(hold_s)],
                            "resources": {"limits": {"nvidia.com/gpu": GPUS_PER_NODE}},
                        }
                    ],
                },
            },
        },
    }


async def run_exclusive(
    api: KubeAPI,
    node_name: str,
    run: Callable[[], Awaitable[CommandResult]],
    *,
    timeout_s: float,
    queue_wait_s: float = 3600.0,
    poll_s: float = 1.0,
) -> CommandResult:
    name = f"gpc-check-{secrets.token_hex(4)}"
    job = placeholder_job(name, node_name, hold_s=int(timeout_s + queue_wait_s))
    await api.apply([job])
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + queue_wait_s
        while True:
            pods = await api.list_items(
                f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"job-name={name}"
            )
            if any(p.get("status", {}).get("phase") == "Running" for p in pods):
                break
            if loop.time() > deadline:
                return CommandResult(
                    returncode=1, stdout="", stderr="the placeholder pod did not start"
                )
            await asyncio.sleep(poll_s)
        return await run()
    finally:
        try:
            await api.delete(
                f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{name}",
                {"propagationPolicy": "Background"},
            )
        except LayerError as exc:  # its activeDeadlineSeconds ends it anyway
            log.warning("placeholder job %s not deleted: %s", name, exc)
