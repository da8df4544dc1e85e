"""Which workload holds each GPU of the node: a Slurm job or a pod.

The metrics export labels every GPU series with what ran on the GPU, so a
job's GPU utilisation, memory and power can be read back for exactly the
GPUs it had, over its lifetime (docs/metrics.md):

* **Slurm**: a job's processes carry ``SLURM_JOB_ID``, ``SLURM_JOB_USER``
  and the GPUs Slurm gave the job (``SLURM_STEP_GPUS`` in a step,
  ``SLURM_JOB_GPUS`` in the batch script; both are GPU indices, the
  gres.conf's ``File=/dev/nvidia<N>`` order). The agent is root in the
  node's PID namespace, so it reads them from ``/proc/<pid>/environ``:
  what dcgm-exporter's HPC job mapping gets from a prolog-written file,
  without a prolog to keep.
* **Kubernetes**: kubelet's pod-resources API (``List``) says which
  container holds which ``nvidia.com/gpu`` device id; our device plugin's
  device ids are the GPUs' UUIDs. This is how dcgm-exporter labels pods.

Both are best effort: a node without Kubernetes has no pod-resources
socket, a process that ends mid-scan is skipped, and a GPU no workload
holds has no workload labels.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
GPU_RESOURCE = "nvidia.com/gpu"
_SLURM_KEYS = (b"SLURM_JOB_ID", b"SLURM_JOB_USER", b"SLURM_STEP_GPUS", b"SLURM_JOB_GPUS")


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    user: str


@dataclass(frozen=True, slots=True)
class PodContainer:
    namespace: str
    pod: str
    container: str


def _environ(path: Path) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for item in path.read_bytes().split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in _SLURM_KEYS:
            out[key] = value
    return out


def _indices(value: bytes) -> list[int]:
    out = []
    for part in value.decode(errors="replace").split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return out


def slurm_gpu_jobs(proc: Path = Path("/proc")) -> dict[int, SlurmJob]:
    """GPU index -> the Slurm job whose processes were given it."""
    out: dict[int, SlurmJob] = {}
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            env = _environ(proc / pid / "environ")
        except OSError:
            continue  # ended, or not ours to read
        job = env.get(b"SLURM_JOB_ID")
        gpus = env.get(b"SLURM_STEP_GPUS") or env.get(b"SLURM_JOB_GPUS")
        if not job or not gpus:
            continue
        holder = SlurmJob(
            job_id=job.decode(errors="replace"),
            user=env.get(b"SLURM_JOB_USER", b"").decode(errors="replace"),
        )
        for index in _indices(gpus):
            out.setdefault(index, holder)
    return out


def pod_gpu_containers(
    socket: Path = POD_RESOURCES_SOCKET, timeout_s: float = 2.0
) -> dict[str, PodContainer]:
    """GPU UUID (our device plugin's device id) -> the container holding it,
    from kubelet's pod-resources API; empty where kubelet does not run."""
    if not socket.exists():
        return {}
    import grpc

    from gpuclusters.agent.podresources import api_pb2, api_pb2_grpc

    out: dict[str, PodContainer] = {}
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            reply = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        log.debug("pod-resources List failed: %s", exc)
        return out
    for pod in reply.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name != GPU_RESOURCE:
                    continue
                for device_id in devices.device_ids:
                    out[device_id] = PodContainer(pod.namespace, pod.name, container.name)
    return out
