"""The preemption protocol on Slurm (see docs/preemptible.md).

T+0 (:func:`preempt`): drain the node with our reason (a user's drain keeps
its reason), record the jobs running there, and send each of them SIGTERM
(``scancel --signal=TERM --batch --full``: the batch shell and every step),
so a job that traps it writes its checkpoint and exits.

Until the deadline (:func:`preemption_done`): the node is done once no job
is left on it. Each job that ran there at T+0 is then requeued (JobRequeue=1;
Slurm 22.05 requeues a finished batch job too) and released at once with
``StartTime=now`` (a requeued job otherwise waits ~120 s with reason
BeginTime), so it resumes from its checkpoint on another node. At the
deadline, jobs still running are requeued by force (``scontrol requeue``
kills and requeues them).

The record lives on the controller (``/var/lib/gpuclusters/preemption/<node>.json``)
and is written *before* any signal: a step repeated after a crash signals
the recorded jobs again (harmless for a job that is checkpointing) and never
forgets one that has already exited. A job is requeued only while its
restart count is still the one recorded at T+0, so a job that already
resumed elsewhere is never requeued twice. Only jobs that ran on the node at
T+0 are requeued this way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.slurm import stack
from gpuclusters.layers.slurm.status import SlurmJob, active_jobs_on

log = logging.getLogger(__name__)

RECORD_DIR = "/var/lib/gpuclusters/preemption"
# Finished states after which a preempted job is requeued.
_ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
)


@dataclass
class PreemptionRecord:
    node: str
    deadline: str
    # job id -> restart count at T+0
    jobs: dict[str, int]
    signalled: bool = False
    requeued: list[int] | None = None


def _path(node: str) -> str:
    return f"{RECORD_DIR}/{node}.json"


async def _read(controller: NodeShell, node: str) -> PreemptionRecord | None:
    raw = await controller.read_file(_path(node))
    if raw is None:
        return None
    try:
        return PreemptionRecord(**json.loads(raw))
    except (ValueError, TypeError):
        return None


async def _write(controller: NodeShell, record: PreemptionRecord) -> None:
    await controller.write_file(
        _path(record.node), json.dumps(asdict(record), indent=2).encode(), mode=0o600
    )


async def running_work(controller: NodeShell, node: str) -> int:
    return len(active_jobs_on(await stack.list_jobs(controller), node))


async def preempt(controller: NodeShell, node: str, *, reason: str, deadline: datetime) -> None:
    """T+0: drain, record the running jobs, SIGTERM them. Idempotent."""
    when = deadline.astimezone(UTC).isoformat()
    record = await _read(controller, node)
    if record is None or record.deadline != when:
        await stack.cordon(controller, node, reason=reason)
        jobs = active_jobs_on(await stack.list_jobs(controller), node)
        record = PreemptionRecord(
            node=node, deadline=when, jobs={str(j.job_id): j.restarts for j in jobs}
        )
        await _write(controller, record)
    if record.signalled:
        return
    for job_id in record.jobs:
        r = await controller.run(
            ["scancel", "--signal=TERM", "--batch", "--full", job_id], check=False
        )
        if r.returncode != 0:  # it ended meanwhile: nothing to tell
            log.info("scancel --signal=TERM %s: %s", job_id, r.stderr.strip())
    record.signalled = True
    await _write(controller, record)


async def preemption_done(
    controller: NodeShell, node: str, *, reason: str, deadline: datetime
) -> bool:
    """True once the node is empty and its T+0 jobs are requeued; from the
    deadline on, requeue what still runs there first."""
    if not await stack.cordon(controller, node, reason=reason):
        return True  # Slurm does not know the node: nothing runs there
    jobs = await stack.list_jobs(controller)
    active = active_jobs_on(jobs, node)
    record = await _read(controller, node)
    if active and datetime.now(UTC) < deadline:
        return False
    for job in active:
        if job.state == "RUNNING":
            await _requeue_now(controller, job.job_id)
    if record is not None:
        await _requeue_ended(controller, record, {j.job_id: j for j in jobs})
    slurm_node = await stack.get_node(controller, node)
    still = active_jobs_on(await stack.list_jobs(controller), node)
    return not still and (slurm_node is None or not slurm_node.busy)


async def _requeue_now(controller: NodeShell, job_id: int) -> bool:
    r = await controller.run(["scontrol", "requeue", str(job_id)], check=False)
    if r.returncode != 0:
        log.warning("scontrol requeue %s: %s", job_id, r.stderr.strip())
        return False
    await _start_now(controller, job_id)
    return True


async def _start_now(controller: NodeShell, job_id: int) -> None:
    # A requeued job waits ~120 s (reason BeginTime) unless told to start now.
    await controller.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=False)


async def _requeue_ended(
    controller: NodeShell, record: PreemptionRecord, jobs: dict[int, SlurmJob]
) -> None:
    requeued = set(record.requeued or [])
    for key, restarts in record.jobs.items():
        job_id = int(key)
        job = jobs.get(job_id)
        if job is None or job_id in requeued:
            continue  # gone from squeue long ago, or done already
        if job.state in _ENDED and job.restarts == restarts:
            if await _requeue_now(controller, job_id):
                requeued.add(job_id)
        elif job.state == "PENDING" and job.reason == "BeginTime":
            # Requeued (by force at the deadline, or before a crash) but not
            # released yet.
            await _start_now(controller, job_id)
            requeued.add(job_id)
    if requeued != set(record.requeued or []):
        record.requeued = sorted(requeued)
        await _write(controller, record)


async def forget(controller: NodeShell, node: str) -> None:
    """Drop the record once the node is gone."""
    await controller.run(["rm", "-f", _path(node)], check=False)
