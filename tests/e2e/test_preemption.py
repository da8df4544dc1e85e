"""Preemptible nodes on real Slurm (netns provider, the default 4-host fleet).

The issue's acceptance, as a user would run it: a cluster with 8 standard
and 16 preemptible GPUs; the checkpointing example runs on the preemptible
nodes; a second cluster needs those hosts, so one preemptible node is
preempted: its job gets SIGTERM, checkpoints, the node is released as soon
as the job has exited (not at the deadline), the job is requeued and resumes
from its checkpoint on another node; when the second cluster goes, the
preemptible target is restored; usage prices preemptible hours at the
discount.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns provider needs root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "checkpointing" / "train.sbatch"
ADMIN_UID = 10000


def ok(server: ServerHandle, *args: str, timeout: float = 180) -> str:
    r = server.cli(*args, timeout=timeout)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def ssh(server: ServerHandle, *cmd: str) -> str:
    return ok(server, "clusters", "ssh", "p1", "--", *cmd)


def submit_from_stdin(server: ServerHandle, script: str, *args: str) -> str:
    """``gpuclusters clusters ssh p1 -- sbatch < script``, as a user would."""
    r = server.cli("clusters", "ssh", "p1", "--", "sbatch", "--parsable", *args, stdin=script)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def get(server: ServerHandle, name: str) -> dict[str, Any]:
    return dict(json.loads(ok(server, "clusters", "get", name, "--output", "json")))


def job_state(server: ServerHandle, job: str) -> dict[str, str]:
    out = ssh(server, "scontrol", "show", "job", job)
    return dict(re.findall(r"(\w+)=(\S*)", out))


def test_preempted_job_checkpoints_and_resumes_elsewhere(server_factory: Servers) -> None:
    server = server_factory(provider="netns", start=False)
    # A short grace window: the test shows release happens when the job
    # exits, long before this deadline.
    server.env["GPUCLUSTERS_PREEMPTION_GRACE_S"] = "120"
    server.start()

    ok(server, "clusters", "create", "p1", "--type", "slurm", "--gpus", "8",
       "--preemptible-gpus", "16", "--wait")  # fmt: skip
    p1 = server.wait_for(
        "16 preemptible GPUs allocated",
        lambda: (c := get(server, "p1"))["allocated_preemptible_gpus"] == 16 and c,
        timeout=180,
    )
    nodes = {n["name"]: n for n in p1["nodes"]}
    standard = next(n for n in nodes if "-standard-" in n)
    preemptible = sorted(n for n in nodes if "-preemptible-" in n)
    assert len(preemptible) == 2
    server.wait_for(
        "3 idle Slurm nodes",
        lambda: ssh(server, "sinfo", "-h", "-N", "-o", "%N %T").count("idle") == 3,
        timeout=60,
    )

    # The example job, from the user's home on the shared volume.
    home = next((server.home / "volumes").glob("*/data")) / "home" / "admin"
    script = home / "train.sbatch"
    shutil.copy(EXAMPLE, script)
    os.chown(script, ADMIN_UID, ADMIN_UID)
    # A placeholder holds the standard node, so the two example jobs land
    # on the preemptible nodes; it goes before the reclaim, leaving room
    # for the requeued job.
    hog = ssh(server, "sbatch", "--parsable", "-w", standard, "--gres=gpu:8",
              "--wrap", "sleep 600").strip()  # fmt: skip
    # One job from the file on the shared volume, one piped in from the
    # user's machine (sbatch reads the script from stdin).
    jobs = {
        "a": ssh(
            server,
            "sbatch",
            "--parsable",
            "--job-name=ckpt-a",
            "--chdir=/home/admin",
            "/home/admin/train.sbatch",
        ).strip(),
        "b": submit_from_stdin(server, EXAMPLE.read_text(), "--job-name=ckpt-b"),
    }
    running = server.wait_for(
        "both example jobs running on preemptible nodes",
        lambda: (
            (states := {t: job_state(server, j) for t, j in jobs.items()})
            and all(s["JobState"] == "RUNNING" for s in states.values())
            and states
        ),
        timeout=60,
    )
    assert sorted(s["NodeList"] for s in running.values()) == preemptible
    ckpt = {t: home / "checkpoints" / f"ckpt-{t}" / "log" for t in jobs}
    server.wait_for(
        "the jobs to start",
        lambda: all(p.exists() and "start" in p.read_text() for p in ckpt.values()),
        timeout=30,
    )
    ssh(server, "scancel", hog)
    server.wait_for(
        "the placeholder job to leave",
        lambda: job_state(server, hog)["JobState"] in ("CANCELLED", "COMPLETED"),
        timeout=30,
    )

    # s2 needs two hosts: the free one, and one a preemptible node holds.
    ok(server, "clusters", "create", "s2", "--type", "slurm", "--gpus", "16", "--wait",
       timeout=400)  # fmt: skip
    events = json.loads(ok(server, "events", "--cluster", "p1", "--output", "json"))
    by_reason: dict[str, dict[str, Any]] = {}
    for e in events:
        by_reason.setdefault(e["reason"], e)
    notified, preempted = by_reason["PreemptionNotified"], by_reason["Preempted"]
    victim = notified["node"]
    assert preempted["node"] == victim and victim in preemptible
    assert notified["timestamp"] <= preempted["timestamp"]
    # Released because its job exited, not because the deadline passed.
    assert "its workloads exited" in preempted["message"], preempted

    # The victim's job checkpointed on SIGTERM and resumed on another node.
    tag = next(t for t, s in running.items() if s["NodeList"] == victim)
    log = ckpt[tag]

    def resumed() -> str | None:
        text = log.read_text()
        return text if "resume" in text else None

    text = server.wait_for("the preempted job to resume", resumed, timeout=120)
    sigterm = re.search(r"sigterm step=(\d+) host=(\S+) deadline=(\S+)", text)
    resume = re.search(r"resume step=(\d+) host=(\S+) restart=(\d+)", text)
    assert sigterm and resume, text
    assert sigterm.group(2) == victim and sigterm.group(3) != "unknown"  # read the notice
    assert resume.group(1) == sigterm.group(1)  # from the checkpoint, not from 0
    assert resume.group(2) != victim and int(resume.group(3)) >= 1
    assert int(sigterm.group(1)) > 0
    state = job_state(server, jobs[tag])
    assert state["JobState"] == "RUNNING" and int(state["Restarts"]) >= 1
    other = next(t for t in jobs if t != tag)
    assert "sigterm" not in ckpt[other].read_text()  # the other node was left alone
    for node in (standard, running[other]["NodeList"]):  # the notice is the victim's own
        ok(server, "clusters", "ssh", "p1", "--node", node, "--",
           "sh", "-c", "test ! -e /run/gpuclusters/preemption.json")  # fmt: skip

    p1 = get(server, "p1")
    assert p1["allocated_preemptible_gpus"] == 8 and p1["desired_preemptible_gpus"] == 16

    # Capacity returns: the target is restored.
    ok(server, "clusters", "delete", "s2", "--wait", timeout=300)
    server.wait_for(
        "the preemptible target restored",
        lambda: get(server, "p1")["allocated_preemptible_gpus"] == 16,
        timeout=240,
    )

    # Usage: preemptible hours at the discounted rate.
    usage = json.loads(ok(server, "usage", "--output", "json"))
    lines = {(ln["cluster"], ln["compute_class"]): ln for ln in usage["lines"]}
    std, pre = lines[("p1", "standard")], lines[("p1", "preemptible")]
    assert pre["nodes"] == 3 and pre["gpu_hours"] > 0  # the first two and a replacement
    assert pre["rate_per_gpu_hour"] == pytest.approx(std["rate_per_gpu_hour"] * 0.4, abs=1e-3)
    assert ("s2", "standard") in lines

    for j in jobs.values():
        ssh(server, "scancel", j)
    ok(server, "clusters", "delete", "p1", "--wait", timeout=300)
