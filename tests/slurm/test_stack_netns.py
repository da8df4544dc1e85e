"""``stack`` against real daemons in the prototype's namespaces.

Needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server
(scripts/setup installs them). The nodes come from
``scripts/setup-slurm-proto nodes`` (removed again by ``down``; a prototype
left up is taken down first).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from slurm_nsshell import NsenterShell

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.slurm import config as cfg
from gpuclusters.layers.slurm import stack
from gpuclusters.layers.slurm.config import SlurmPaths, SlurmSpec
from gpuclusters.layers.slurm.status import SlurmNode

PROTO = Path(__file__).resolve().parents[2] / "scripts" / "setup-slurm-proto"
SHARED = Path("/tmp/gpct-shared")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces)"),
    pytest.mark.skipif(
        not all(shutil.which(b) for b in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd")),
        reason="Slurm/munge/MariaDB packages not installed",
    ),
]


@dataclass
class Cluster:
    spec: SlurmSpec
    key: bytes
    ctl: NodeShell
    login: NodeShell
    n1: NodeShell
    n2: NodeShell
    rogue: NodeShell
    bring_up_s: float


PROTO_PATHS = SlurmPaths(mysql_datadir="/var/lib/mysql")


@pytest.fixture
def proto_nodes() -> Iterator[None]:
    """Bare nodes from the prototype script; everything is removed afterwards.

    `down` runs first as well: a run killed mid-test (no fixture teardown), or
    `scripts/setup-slurm-proto up` left running, leaves the script's namespaces
    and /tmp/gpct-* directories (whose /etc upper layers already hold the job
    user, so the next `nodes` would stop on useradd). Cleaned, never skipped.
    """
    subprocess.run([str(PROTO), "down"], check=False, capture_output=True)
    try:
        subprocess.run([str(PROTO), "nodes"], check=True, capture_output=True)
        yield
    finally:
        subprocess.run([str(PROTO), "down"], check=False, capture_output=True)


@pytest.fixture
async def cluster(proto_nodes: None) -> AsyncIterator[Cluster]:
    spec = SlurmSpec(
        cluster_name="gpct1",
        controller_host="gpct-ctl",
        controller_addr="10.232.0.10",
        gpu_type="h100",
        # The prototype's namespaces bind a private directory at
        # /var/lib/mysql (their /var is the host's, not an overlay).
        paths=PROTO_PATHS,
    )
    c = Cluster(
        spec=spec,
        key=os.urandom(128),
        ctl=NsenterShell("gpct-ctl", "10.232.0.10"),
        login=NsenterShell("gpct-login", "10.232.0.20"),
        n1=NsenterShell("gpct-n1", "10.232.0.11"),
        n2=NsenterShell("gpct-n2", "10.232.0.12"),
        rogue=NsenterShell("gpct-rogue", "10.232.0.30"),
        bring_up_s=0.0,
    )
    t0 = time.monotonic()
    await stack.start_controller(c.ctl, spec, munge_key=c.key)
    t1 = time.monotonic()
    await asyncio.gather(
        stack.start_login(c.login, spec, munge_key=c.key),
        stack.join_compute(c.ctl, c.n1, spec, munge_key=c.key),
        stack.join_compute(c.ctl, c.n2, spec, munge_key=c.key),
    )
    c.bring_up_s = time.monotonic() - t0
    print(f"controller {t1 - t0:.2f} s; login + 2 computes {time.monotonic() - t1:.2f} s")
    yield c


async def sbatch(c: Cluster, *args: str, user: str = "alice") -> int:
    r = await c.login.run(["sbatch", "--parsable", *args], user=user)
    return int(r.stdout.strip().split(";")[0])


async def test_cluster_lifecycle(cluster: Cluster) -> None:
    c = cluster
    nodes = {n.name: n for n in await stack.list_nodes(c.login)}
    assert sorted(nodes) == ["gpct-n1", "gpct-n2"]
    assert all(n.state == "idle" and n.gres == "gpu:h100:8" for n in nodes.values())

    # A two-node GPU job as a non-root user; --gres=gpu:8 matches typed GRES.
    (SHARED / "job.sh").write_text(
        "#!/bin/sh\nsrun hostname\n"
        "srun sh -c 'echo \"$(hostname) $(id -un) CUDA=$CUDA_VISIBLE_DEVICES\"'\n"
    )
    (SHARED / "job.sh").chmod(0o755)
    await sbatch(
        c, "--wait", "-N2", "--gres=gpu:8", "-o", "/mnt/shared/out.txt", "/mnt/shared/job.sh"
    )
    out = (SHARED / "out.txt").read_text().split("\n")
    assert sorted(out[:2]) == ["gpct-n1", "gpct-n2"]
    assert "gpct-n1 alice CUDA=0,1,2,3,4,5,6,7" in out
    assert "gpct-n2 alice CUDA=0,1,2,3,4,5,6,7" in out

    async def completed() -> bool | None:
        jobs = await stack.accounted_jobs(c.login)
        return True if [j.state for j in jobs] == ["COMPLETED"] else None

    await stack.wait_for(completed, what="sacct COMPLETED", timeout_s=15)

    config = (await c.login.run(["scontrol", "show", "config"])).stdout
    for line in (
        "KillWait                = 30 sec",
        "MaxArraySize            = 1000",
        "JobRequeue              = 1",
    ):
        assert line in config

    # Another cluster's munge key is refused.
    await stack.ensure_munge(c.rogue, c.spec, munge_key=os.urandom(128))
    await c.rogue.write_file(
        "/etc/slurm/slurm.conf", (await c.login.read_file("/etc/slurm/slurm.conf")) or b""
    )
    assert not await stack.ping(c.rogue)
    assert (await c.rogue.run(["sinfo"], check=False)).returncode != 0

    # A prolog that fails on gpct-n2, applied live: the node drains, the job is requeued (not held).
    spec2 = SlurmSpec(
        cluster_name=c.spec.cluster_name,
        controller_host=c.spec.controller_host,
        controller_addr=c.spec.controller_addr,
        gpu_type=c.spec.gpu_type,
        paths=PROTO_PATHS,
        prolog_script='#!/bin/sh\n[ "$(hostname)" = gpct-n2 ] && exit 1\nexit 0\n',
    )
    assert await stack.apply_config(c.ctl, spec2, logins=[c.login], computes=[c.n1, c.n2])
    assert "/etc/slurm/prolog.sh" in (await c.login.run(["scontrol", "show", "config"])).stdout
    job = await sbatch(c, "-N1", "-w", "gpct-n2", "-o", "/dev/null", "--wrap", "true")

    async def requeued() -> bool | None:
        j = next(j for j in await stack.list_jobs(c.login) if j.job_id == job)
        n = await stack.get_node(c.login, "gpct-n2")
        ok = j.state == "PENDING" and j.restarts == 1 and "held" not in j.reason
        return True if ok and n is not None and n.drain and n.reason == "Prolog error" else None

    await stack.wait_for(requeued, what="prolog failure to drain and requeue", timeout_s=20)
    assert await stack.is_cordoned_by_user(c.ctl, "gpct-n2")  # not our drain
    assert not await stack.uncordon(c.ctl, "gpct-n2")  # never cleared by us

    # Our own drain of an idle node: empty at once, and ours to undo.
    assert await stack.drain(c.ctl, "gpct-n1", reason="scale-down")
    n1 = await stack.get_node(c.ctl, "gpct-n1")
    assert n1 is not None and n1.reason == "gpuclusters: scale-down"
    assert not await stack.is_cordoned_by_user(c.ctl, "gpct-n1")
    assert await stack.uncordon(c.ctl, "gpct-n1")

    # Dynamic removal, then the same node joins again.
    await c.ctl.run(["scancel", str(job)])
    await stack.remove(c.ctl, "gpct-n2", node=c.n2)
    assert [n.name for n in await stack.list_nodes(c.ctl)] == ["gpct-n1"]
    await stack.remove(c.ctl, "gpct-n2", node=c.n2)  # idempotent
    node = await stack.join_compute(c.ctl, c.n2, c.spec, munge_key=c.key)
    assert node.schedulable

    # Idempotent bring-up: a second pass changes nothing and is quick.
    t0 = time.monotonic()
    await stack.start_controller(c.ctl, spec2, munge_key=c.key)
    await stack.join_compute(c.ctl, c.n1, spec2, munge_key=c.key)
    print(f"second pass {time.monotonic() - t0:.2f} s; first bring-up {c.bring_up_s:.2f} s")


async def test_power_saving_slots(proto_nodes: None) -> None:
    """Autoscaling's Slurm half (docs/autoscaling.md): slots are State=CLOUD
    nodes; a job asks for them (POWERING_UP), nodes join as them and run it,
    Slurm powers them down after SuspendTime idle, a released slot is not
    left drained and is asked for again by the next job."""
    slots = ("gpct1-as1", "gpct1-as2")
    spec = SlurmSpec(
        cluster_name="gpct1",
        controller_host="gpct-ctl",
        controller_addr="10.232.0.10",
        gpu_type="h100",
        paths=PROTO_PATHS,
        cloud=cfg.CloudNodes(
            names=slots, suspend_time_s=10, suspend_timeout_s=5, features=("standard",)
        ),
    )
    key = os.urandom(128)
    ctl = NsenterShell("gpct-ctl", "10.232.0.10")
    login = NsenterShell("gpct-login", "10.232.0.20")
    n1 = NsenterShell("gpct-n1", "10.232.0.11")
    n2 = NsenterShell("gpct-n2", "10.232.0.12")
    await stack.start_controller(ctl, spec, munge_key=key)
    await stack.start_login(login, spec, munge_key=key)

    async def states() -> dict[str, SlurmNode]:
        return {n.name: n for n in await stack.list_nodes(ctl) if n.name in slots}

    start = await states()
    assert sorted(start) == list(slots)
    assert all(n.powered_down and not n.powering_up for n in start.values())

    # A two-node job on a cluster with no node: Slurm asks for both slots.
    (SHARED / "auto.sh").write_text("#!/bin/sh\nsrun hostname\n")
    (SHARED / "auto.sh").chmod(0o755)
    job = await sbatch(
        Cluster(spec, key, ctl, login, n1, n2, n2, 0.0),
        "-N2",
        "--gres=gpu:8",
        "-o",
        "/mnt/shared/auto.txt",
        "/mnt/shared/auto.sh",
    )

    async def asked() -> bool | None:
        now = await states()
        return True if all(n.powering_up for n in now.values()) else None

    await stack.wait_for(asked, what="Slurm to power both slots up", timeout_s=30)
    log = (await ctl.read_file(spec.paths.power_log)) or b""
    assert b"resume gpct1-as[1-2]" in log

    # Nodes join as the slots; the pending job runs on them.
    await asyncio.gather(
        stack.join_compute(ctl, n1, spec, munge_key=key, features=["standard"], slot=slots[0]),
        stack.join_compute(ctl, n2, spec, munge_key=key, features=["standard"], slot=slots[1]),
    )

    async def done() -> bool | None:
        jobs = [j for j in await stack.list_jobs(ctl) if j.job_id == job]
        return True if jobs and jobs[0].state == "COMPLETED" else None

    await stack.wait_for(done, what="the job to run on the new nodes", timeout_s=60)
    assert sorted((SHARED / "auto.txt").read_text().split()) == ["gpct-n1", "gpct-n2"]
    joined = await states()
    assert joined[slots[0]].address == "10.232.0.11"  # cloud_reg_addrs

    # Idle past SuspendTime: Slurm powers both down.
    async def released() -> bool | None:
        now = await states()
        return True if all(n.powering_down or n.powered_down for n in now.values()) else None

    await stack.wait_for(released, what="Slurm to power the idle slots down", timeout_s=60)
    assert b"suspend gpct1-as[1-2]" in ((await ctl.read_file(spec.paths.power_log)) or b"")
    await stack.release_slot(ctl, slots[0], node=n1)
    await stack.release_slot(ctl, slots[1], node=n2)
    assert not await n1.is_running("slurmd")

    # The next job asks for a slot again once it is powered down.
    await sbatch(
        Cluster(spec, key, ctl, login, n1, n2, n2, 0.0), "-N1", "-o", "/dev/null", "--wrap", "true"
    )

    async def asked_again() -> bool | None:
        now = await states()
        return True if any(n.powering_up for n in now.values()) else None

    await stack.wait_for(asked_again, what="a slot asked for again", timeout_s=60)
    assert not any(n.drain for n in (await states()).values())
