"""Autoscaled Slurm clusters on the embedded fleet (docs/autoscaling.md),
end to end, as a user works: from the laptop's own network namespace, as a
non-root account, with the CLI over TLS.

Slurm's power saving decides (a pending job asks for slots; idle slots are
powered down after the idle time) and the server follows: nodes are placed
for the slots Slurm asks for, and released once Slurm powered them down.
The tests run in file order and build on each other: the issue's
acceptance (0 -> 2 nodes -> 0), quotas bounding both a create and a
scale-up, then a cluster at 1 node growing to 3 for a ``-N3`` job and
shrinking back to its ``min_gpus``. The idle time is 30 s here (the
default is 600 s), so a run takes minutes, not hours.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netlab import Laptop

from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
IDLE_S = 30
# A node is asked for, placed, booted and joined to Slurm and Kubernetes.
GROW_WITHIN_S = 240.0
# Idle time, then Slurm's suspend, the autoscaler's next pass and the release.
SHRINK_WITHIN_S = IDLE_S + 180.0


class World:
    def __init__(self, server: ServerHandle, laptop: Laptop) -> None:
        self.server = server
        self.laptop = laptop
        self.figures: dict[str, float] = {}

    def admin(self, *args: str, timeout: float = 180) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def cli(self, *args: str, timeout: float = 300) -> Any:
        return self.laptop.run("gpuclusters", *args, timeout=timeout)

    def ok(self, *args: str, timeout: float = 300) -> str:
        r = self.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"laptop: gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def get(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.ok("clusters", "get", name, "--output", "json")))

    def ssh(self, name: str, *cmd: str, timeout: float = 300) -> str:
        return self.ok("clusters", "ssh", name, "--", *cmd, timeout=timeout)

    def events(self, name: str) -> list[dict[str, Any]]:
        out = self.ok("events", "--cluster", name, "--output", "json")
        return list(json.loads(out))

    def job_times(self, name: str, job: str) -> tuple[datetime, datetime, datetime]:
        """Slurm's own submit, start and end of a job (UTC, the nodes' zone)."""
        out = self.ssh(name, "sacct", "-j", job, "-X", "-n", "-P", "-o", "Submit,Start,End")
        submit, start, end = (
            datetime.fromisoformat(t).replace(tzinfo=UTC)
            for t in out.strip().splitlines()[0].split("|")
        )
        return submit, start, end

    def record(self, prefix: str, name: str, job: str) -> None:
        """Figures from timestamps, not from this test's polling: Slurm's for
        the job, the API's events for the autoscaler's decisions."""
        submit, start, end = self.job_times(name, job)
        downs = [
            datetime.fromisoformat(e["timestamp"])
            for e in self.events(name)
            if e["reason"] == "ScaledDown"
        ]
        self.figures[f"{prefix}_pending_to_running_s"] = (start - submit).total_seconds()
        self.figures[f"{prefix}_job_end_to_release_s"] = round(
            (max(downs) - end).total_seconds(), 1
        )
        self.figures["idle_s"] = IDLE_S

    def wait_size(self, name: str, gpus: int, *, timeout: float) -> dict[str, Any]:
        def at_size() -> dict[str, Any] | None:
            c = self.get(name)
            return c if c["num_gpus"] == gpus and len(c["nodes"]) == gpus // 8 else None

        result: dict[str, Any] = self.server.wait_for(
            f"{name} at {gpus} GPUs", at_size, timeout=timeout, interval=2.0
        )
        return result


@pytest.fixture(scope="module")
def world(module_servers: Servers) -> Iterator[World]:
    laptop = Laptop(PROJECT_ROOT)
    try:
        laptop.up()
        server = module_servers(provider="netns", start=False, public_host=laptop.gateway)
        server.env["GPUCLUSTERS_TLS"] = "on"
        server.env["GPUCLUSTERS_TLS_PORT"] = str(free_port())
        server.env["GPUCLUSTERS_AUTOSCALE_INTERVAL_S"] = "2"
        server.start()
        w = World(server, laptop)
        key = json.loads(
            w.admin(
                "api-keys",
                "create",
                "--user",
                "alice",
                "--project",
                "default",
                "--role",
                "admin",
                "--output",
                "json",
            )
        )["key"]
        (laptop.home / "ca.pem").write_bytes((server.home / "tls" / "ca.pem").read_bytes())
        url = f"https://{laptop.gateway}:{server.env['GPUCLUSTERS_TLS_PORT']}"
        w.ok("login", "--url", url, "--api-key", key, "--ca-file", f"{laptop.home}/ca.pem")
        yield w
        if w.figures:
            print("\nautoscaling figures:", json.dumps(w.figures))
    finally:
        module_servers.close()  # before the laptop's network goes
        laptop.close()


def test_acceptance_zero_to_two_nodes_and_back(world: World) -> None:
    created = json.loads(
        world.ok(
            "clusters",
            "create",
            "auto",
            "--type",
            "slurm",
            "--gpus",
            "0",
            "--autoscale-max",
            "16",
            "--autoscale-idle",
            str(IDLE_S),
            "--wait",
            "--output",
            "json",
            timeout=600,
        )
    )
    assert created["status"] == "ready" and created["num_gpus"] == 0 and created["nodes"] == []
    assert created["autoscaling"] == {"min_gpus": 0, "max_gpus": 16, "idle_s": IDLE_S}
    # Slurm knows the two slots, powered down (idle~).
    sinfo = world.ssh("auto", "sinfo", "-N", "-h", "-o", "%N %t")
    assert sorted(sinfo.split()) == sorted(["auto-as1", "auto-as2", "idle~", "idle~"])

    t0 = time.monotonic()
    out = world.ssh(
        "auto",
        "sbatch",
        "--wait",
        "-N2",
        "--gres=gpu:8",
        "--wrap",
        "srun hostname",
        timeout=GROW_WITHIN_S + 60,
    )
    world.figures["slurm_0_to_2_sbatch_wait_s"] = round(time.monotonic() - t0, 1)
    job = out.split()[-1]
    grown = world.get("auto")
    assert grown["num_gpus"] == 16
    names = sorted(n["name"] for n in grown["nodes"])
    printed = world.ssh("auto", "cat", f"slurm-{job}.out").split()
    assert sorted(printed) == names  # two hostnames: the nodes added for the job
    ready = [n["ready_at"] for n in grown["nodes"]]
    assert all(ready)
    events = world.events("auto")
    ups = [e for e in events if e["reason"] == "ScaledUp"]
    assert len(ups) == 2 and all(f"pending job(s) {job}" in e["message"] for e in ups)

    shrunk = world.wait_size("auto", 0, timeout=SHRINK_WITHIN_S)
    world.record("slurm_0_to_2", "auto", job)
    assert shrunk["status"] == "ready"
    downs = [e for e in world.events("auto") if e["reason"] == "ScaledDown"]
    assert len(downs) == 2 and all(f"idle for {IDLE_S} s" in e["message"] for e in downs)
    # The slots wait, powered down (after SuspendTimeout), for the next job;
    # none was left drained.
    world.server.wait_for(
        "both slots powered down",
        lambda: (
            sorted(world.ssh("auto", "sinfo", "-N", "-h", "-o", "%N %t").split())
            == sorted(["auto-as1", "auto-as2", "idle~", "idle~"])
        ),
        timeout=90,
        interval=3.0,
    )


def test_quota_bounds_creates_and_scale_ups(world: World) -> None:
    world.admin("projects", "quota", "set", "--standard-gpus", "8")
    refused = world.cli(
        "clusters", "create", "big", "--type", "slurm", "--gpus", "16", "--output", "json"
    )
    assert refused.returncode != 0
    assert "standard_gpus" in refused.stderr and "quota" in refused.stderr
    assert "big" not in world.ok("clusters", "list")

    # Slurm asks for two slots; the quota lets one be placed, and says so.
    job = world.ssh("auto", "sbatch", "--parsable", "-N2", "--gres=gpu:8", "--wrap", "true").strip()

    def blocked() -> list[dict[str, Any]] | None:
        found = [e for e in world.events("auto") if e["reason"] == "ScaleUpBlocked"]
        return found or None

    events = world.server.wait_for(
        "a blocked scale-up", blocked, timeout=GROW_WITHIN_S, interval=2.0
    )
    assert "standard_gpus" in events[0]["message"] and f"job(s) {job}" in events[0]["message"]
    world.wait_size("auto", 8, timeout=GROW_WITHIN_S)
    assert world.get("auto")["num_gpus"] == 8  # never past the quota
    world.ssh("auto", "scancel", job)
    world.admin("projects", "quota", "set", "--standard-gpus", "none")
    world.wait_size("auto", 0, timeout=SHRINK_WITHIN_S)


def test_grows_from_one_node_for_a_three_node_job_and_back_to_min(world: World) -> None:
    world.ok(
        "clusters",
        "create",
        "grow",
        "--type",
        "slurm",
        "--gpus",
        "8",
        "--autoscale-max",
        "24",
        "--autoscale-idle",
        str(IDLE_S),
        "--wait",
        timeout=600,
    )
    first = world.wait_size("grow", 8, timeout=60)["nodes"][0]["name"]
    t0 = time.monotonic()
    out = world.ssh(
        "grow",
        "sbatch",
        "--wait",
        "-N3",
        "--gres=gpu:8",
        "-o",
        "three.out",
        "--wrap",
        "srun hostname",
        timeout=GROW_WITHIN_S + 60,
    )
    world.figures["slurm_1_to_3_sbatch_wait_s"] = round(time.monotonic() - t0, 1)
    assert "Submitted batch job" in out
    three = world.get("grow")
    assert three["num_gpus"] == 24
    assert sorted(world.ssh("grow", "cat", "three.out").split()) == sorted(
        n["name"] for n in three["nodes"]
    )
    # Back to min_gpus: the two added nodes go, the first one stays.
    back = world.wait_size("grow", 8, timeout=SHRINK_WITHIN_S)
    world.record("slurm_1_to_3", "grow", out.split()[-1])
    assert [n["name"] for n in back["nodes"]] == [first]
    # It stays at min_gpus past another idle time (SuspendExcNodes keeps one).
    time.sleep(IDLE_S + 10)
    assert [n["name"] for n in world.get("grow")["nodes"]] == [first]
    world.ok("clusters", "delete", "grow", "--wait", timeout=300)


GPU_JOB = """\
apiVersion: batch/v1
kind: Job
metadata: {name: two-by-eight}
spec:
  parallelism: 2
  completions: 2
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: localhost/gpuclusters-base:latest
        command: ["sh", "-c", "hostname; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"]
        resources:
          limits: {nvidia.com/gpu: 8}
"""


def test_kubernetes_job_scales_a_zero_gpu_cluster_up_and_back(world: World) -> None:
    """A Job of 2 pods x 8 GPUs on a Kubernetes cluster at 0 GPUs: its
    pending pods add two nodes, it runs, and the nodes go after the idle time."""
    world.ok(
        "clusters", "create", "kauto", "--type", "kubernetes", "--gpus", "0",
        "--autoscale-max", "16", "--autoscale-idle", str(IDLE_S), "--wait", timeout=600,
    )  # fmt: skip
    kubeconfig = f"{world.laptop.home}/kauto.kubeconfig"
    world.ok("clusters", "credentials", "kauto", "--file", kubeconfig)
    kubectl = ["kubectl", "--kubeconfig", kubeconfig]
    r = world.laptop.run(*kubectl, "apply", "-f", "-", stdin=GPU_JOB, timeout=120)
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    done = world.laptop.run(
        *kubectl, "wait", "--for=condition=complete", "job/two-by-eight",
        f"--timeout={int(GROW_WITHIN_S)}s", timeout=GROW_WITHIN_S + 30,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr, world.events("kauto"))
    world.figures["k8s_0_to_2_job_complete_s"] = round(time.monotonic() - t0, 1)
    grown = world.get("kauto")
    assert grown["num_gpus"] == 16
    logs = world.laptop.run(*kubectl, "logs", "job/two-by-eight", "--all-containers",
                            "--prefix", timeout=60)  # fmt: skip
    ups = [e for e in world.events("kauto") if e["reason"] == "ScaledUp"]
    assert len(ups) == 2 and all("pending pod(s) default/two-by-eight" in e["message"] for e in ups)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in logs.stdout, logs.stdout
    t1 = time.monotonic()
    world.wait_size("kauto", 0, timeout=SHRINK_WITHIN_S)
    world.figures["k8s_job_done_to_0_gpus_s"] = round(time.monotonic() - t1, 1)
    downs = [e for e in world.events("kauto") if e["reason"] == "ScaledDown"]
    assert len(downs) == 2 and all(f"idle for {IDLE_S} s" in e["message"] for e in downs)
    world.ok("clusters", "delete", "kauto", "--wait", timeout=300)
