"""Kubernetes users bring their own images (docs/kubernetes.md "Images").

As in test_remote_access, everything user-facing runs on a "laptop" (its
own network namespace, a non-root account, the CLI from its own virtual
environment, Debian's ``skopeo`` and the cluster's ``kubectl``): log in,
``gpuclusters registry login``, push an image of one's own with ``skopeo
copy`` to the registry address the cluster's JSON shows, run it as a
Deployment behind a Service, reach that Service by name from another pod.
A user of another project can neither pull nor push the first project's
images, and pushes to their own.

One Kubernetes cluster (2 nodes) serves the module; tests run in file order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netlab import Laptop

from gpuclusters.imagebuild import umoci
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.server.settings import Settings
from support.servers import wait_for

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

PROJECT_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(shutil.which("skopeo") is None, reason="run scripts/setup first"),
    pytest.mark.skipif(
        not (DEFAULT_BIN_DIR / "kubectl").exists() or not Settings().registry_bin.is_file(),
        reason="run scripts/setup first (Kubernetes and add-on binaries)",
    ),
]
PAGE = "served from an image pushed by its user"


class World:
    def __init__(self, server: ServerHandle, laptop: Laptop) -> None:
        self.server = server
        self.laptop = laptop
        self.cluster: dict[str, Any] = {}

    def admin(self, *args: str, timeout: float = 180) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def api_key(self, user: str, project: str, role: str) -> str:
        out = self.admin(
            "api-keys", "create", "--user", user, "--project", project, "--role", role,
            "--output", "json",
        )  # fmt: skip
        return str(json.loads(out)["key"])

    def user(self, *argv: str, home: str = ".gpuclusters", timeout: float = 180) -> Any:
        """A command of the laptop's user; ``home`` picks the CLI config
        (and, through it, whose registry credentials are used)."""
        env = {
            "GPUCLUSTERS_HOME": f"{self.laptop.home}/{home}",
            "REGISTRY_AUTH_FILE": f"{self.laptop.home}/{home}/registry-auth.json",
        }
        return self.laptop.run(*argv, env=env, timeout=timeout)

    def ok(self, *argv: str, home: str = ".gpuclusters", timeout: float = 180) -> str:
        r = self.user(*argv, home=home, timeout=timeout)
        assert r.returncode == 0, f"laptop: {' '.join(argv)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 120) -> Any:
        kc = f"{self.laptop.home}/kubeconfig"
        return self.laptop.run("kubectl", "--kubeconfig", kc, *args, stdin=stdin, timeout=timeout)


@pytest.fixture(scope="module")
def world(module_servers: Servers) -> Iterator[World]:
    laptop = Laptop(PROJECT_ROOT)
    try:
        laptop.up()
        server = module_servers(provider="netns", start=False, public_host=laptop.gateway)
        # The tools' images too (scripts/build-images builds them).
        server.env["GPUCLUSTERS_REGISTRY_SYSTEM_IMAGES"] = '["base", "pause", "kueue", "skypilot"]'
        server.start()
        yield World(server, laptop)
    finally:
        module_servers.close()
        laptop.close()


def _login(world: World, user: str, project: str, home: str) -> None:
    key = world.api_key(user, project, "editor" if user != "alice" else "admin")
    ca = world.server.home / "tls" / "ca.pem"
    (world.laptop.home / "ca.pem").write_bytes(ca.read_bytes())
    url = f"https://{world.laptop.gateway}:{world.server.env['GPUCLUSTERS_TLS_PORT']}"
    world.ok("gpuclusters", "login", "--url", url, "--api-key", key,
             "--ca-file", f"{world.laptop.home}/ca.pem", home=home)  # fmt: skip


def _app_archive(laptop: Laptop) -> Path:
    """The user's own image: busybox plus a web page, two layers, as an OCI
    archive on the laptop, assembled by umoci (how they built it does not
    matter to the registry)."""
    page = images.TarWriter()
    page.dir("www")
    page.file("www/index.html", (PAGE + "\n").encode())
    work = laptop.home / "build"
    work.mkdir(exist_ok=True)
    base, web = images.base_layer(), page.close()
    config = umoci.ImageConfig(
        env=(images.PATH_ENV,), cmd=("httpd", "-f", "-p", "8080", "-h", "/www")
    )
    path = laptop.home / "web.tar"
    layers = [(lambda out: out.write(base), "busybox"), (lambda out: out.write(web), "page")]
    umoci.build_archive(path, "1", layers, config, work)
    os.chown(path, laptop.uid, laptop.uid)
    return path


def test_push_an_image_with_skopeo(world: World) -> None:
    _login(world, "alice", "default", ".gpuclusters")
    out = json.loads(world.ok("gpuclusters", "registry", "login", "--output", "json"))
    address = out["address"]
    assert address == f"{world.laptop.gateway}:{world.server.env['GPUCLUSTERS_REGISTRY_PORT']}"
    assert out["push_to"] == f"{address}/default/NAME:TAG"
    archive = _app_archive(world.laptop)
    # No flags: the credentials and the CA come from `registry login`.
    world.ok("skopeo", "copy", "--quiet", f"oci-archive:{archive}",
             f"docker://{address}/default/web:1")  # fmt: skip
    inspected = json.loads(world.ok("skopeo", "inspect", f"docker://{address}/default/web:1"))
    assert inspected["Name"] == f"{address}/default/web"
    # Without credentials, nothing.
    anon = world.laptop.run(
        "skopeo", "inspect", "--no-creds", f"docker://{address}/default/web:1",
        env={"REGISTRY_AUTH_FILE": "/dev/null"},
    )  # fmt: skip
    assert anon.returncode != 0


def test_pods_run_the_pushed_image_behind_a_service(world: World) -> None:
    out = world.ok("gpuclusters", "clusters", "create", "imgs", "--type", "kubernetes",
                   "--gpus", "16", "--wait", "--output", "json", timeout=300)  # fmt: skip
    world.cluster = json.loads(out)
    registry = world.cluster["registry"]
    assert (
        registry
        == f"{world.laptop.gateway}:{world.server.env['GPUCLUSTERS_REGISTRY_PORT']}/default"
    )
    world.ok("gpuclusters", "clusters", "credentials", "imgs",
             "--file", f"{world.laptop.home}/kubeconfig")  # fmt: skip
    manifest = f"""
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      containers:
      - name: web
        image: {registry}/web:1
        ports: [{{containerPort: 8080}}]
---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 8080}}]
"""
    applied = world.kubectl("apply", "-f", "-", stdin=manifest)
    assert applied.returncode == 0, applied.stderr
    rolled = world.kubectl("rollout", "status", "deployment/web", "--timeout=120s", timeout=150)
    if rolled.returncode != 0:
        described = world.kubectl("describe", "pods", "-l", "app=web")
        pytest.fail(f"deployment web not ready: {rolled.stderr}\n{described.stdout}")
    # Another pod, on either node, reaches the Service by its name.
    fetched = _run_pod(world, "fetch", f"{registry}/web:1", "wget", "-q", "-O", "-", "http://web/")
    assert PAGE in fetched


def test_kubectl_top_nodes_answers(world: World) -> None:
    # metrics-server (an aggregated API) answers the laptop's kubectl.
    def top() -> list[str] | None:
        r = world.kubectl("top", "nodes", "--no-headers")
        rows = [line.split() for line in r.stdout.splitlines() if line.strip()]
        # A node metrics-server has not scraped yet reads "<unknown>".
        scraped = all("<unknown>" not in row for row in rows)
        return rows if r.returncode == 0 and len(rows) == 2 and scraped else None

    rows = wait_for("kubectl top nodes to show both nodes", top, timeout=120, interval=1)
    for name, cpu, _cpu_pct, memory, _mem_pct in rows:
        assert name.startswith("imgs-"), rows
        assert cpu.endswith("m") and memory.endswith("Mi"), rows


def _run_pod(world: World, name: str, image: str, *command: str) -> str:
    """``kubectl run`` to completion; its output (deleted afterwards)."""
    started = world.kubectl("run", name, f"--image={image}", "--restart=Never", "--", *command)
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 120
        phase = ""
        while time.monotonic() < deadline:
            got = world.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}")
            phase = got.stdout.strip()
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(1)
        logs = world.kubectl("logs", name).stdout
        if phase != "Succeeded":
            described = world.kubectl("describe", "pod", name).stdout
            pytest.fail(f"pod {name} ended {phase!r}:\n{logs}\n{described}")
        return str(logs)
    finally:
        world.kubectl("delete", "pod", name, "--wait=false")


def test_another_project_can_neither_pull_nor_push(world: World) -> None:
    world.admin("projects", "create", "vision")
    _login(world, "bob", "vision", ".bob")
    out = json.loads(world.ok("gpuclusters", "registry", "login", "--output", "json", home=".bob"))
    address = out["address"]
    denied_pull = world.user("skopeo", "inspect", f"docker://{address}/default/web:1", home=".bob")
    assert denied_pull.returncode != 0
    assert "unauthorized" in denied_pull.stderr.lower() or "denied" in denied_pull.stderr.lower()
    archive = world.laptop.home / "web.tar"
    denied_push = world.user("skopeo", "copy", "--quiet", f"oci-archive:{archive}",
                             f"docker://{address}/default/bob:1", home=".bob")  # fmt: skip
    assert denied_push.returncode != 0
    # Their own project's repositories are theirs.
    world.ok("skopeo", "copy", "--quiet", f"oci-archive:{archive}",
             f"docker://{address}/vision/web:1", home=".bob")  # fmt: skip
    # And alice's pull credential in her cluster does not reach bob's images.
    started = _pod_phase_after(world, "stranger", f"{address}/vision/web:1")
    assert started in ("Pending",), started


def _pod_phase_after(world: World, name: str, image: str) -> str:
    """Start a pod of ``image`` and return its phase once the pull failed
    (the image pull error shows in its container status)."""
    r = world.kubectl("run", name, f"--image={image}", "--restart=Never", "--", "true")
    assert r.returncode == 0, r.stderr
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = world.kubectl("get", "pod", name, "-o", "json")
            pod = json.loads(got.stdout)
            waiting = [
                s.get("state", {}).get("waiting", {}).get("reason", "")
                for s in pod.get("status", {}).get("containerStatuses", [])
            ]
            if any(w in ("ErrImagePull", "ImagePullBackOff") for w in waiting):
                return str(pod["status"]["phase"])
            time.sleep(1)
        pytest.fail(f"pod {name} never failed to pull: {pod.get('status')}")
    finally:
        world.kubectl("delete", "pod", name, "--wait=false")


KUEUE_QUEUES = """
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: default-flavor}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: cluster-queue}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: ["cpu", "memory", "nvidia.com/gpu"]
    flavors:
    - name: default-flavor
      resources:
      - {name: cpu, nominalQuota: 9}
      - {name: memory, nominalQuota: 36Gi}
      - {name: nvidia.com/gpu, nominalQuota: 8}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {namespace: default, name: user-queue}
spec: {clusterQueue: cluster-queue}
"""


def kueue_job(name: str, seconds: int) -> str:
    return f"""
apiVersion: batch/v1
kind: Job
metadata:
  name: {name}
  labels: {{kueue.x-k8s.io/queue-name: user-queue}}
spec:
  suspend: true
  parallelism: 1
  completions: 1
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: localhost/gpuclusters-base:latest
        command: ["sh", "-c", "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; sleep {seconds}"]
        resources:
          requests: {{cpu: 100m, memory: 64Mi, nvidia.com/gpu: 8}}
          limits: {{nvidia.com/gpu: 8}}
"""


def _job(world: World, name: str) -> dict[str, Any]:
    r = world.kubectl("get", "job", name, "-o", "json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_kueue_queues_a_second_gpu_job_behind_the_first(world: World) -> None:
    from gpuclusters.layers.kubernetes import ecosystem

    # The release manifest with its image reference rewritten (the user
    # downloaded it; docs/ecosystem/kueue.md), applied as Kueue's docs say.
    manifest = world.laptop.home / "kueue-manifests.yaml"
    manifest.write_text(ecosystem.render("kueue"))
    applied = world.kubectl("apply", "--server-side", "-f", str(manifest), timeout=300)
    assert applied.returncode == 0, applied.stderr
    up = world.kubectl("-n", "kueue-system", "wait", "deployment/kueue-controller-manager",
                       "--for=condition=available", "--timeout=240s", timeout=260)  # fmt: skip
    if up.returncode != 0:
        pods = world.kubectl("-n", "kueue-system", "describe", "pods").stdout
        pytest.fail(f"kueue did not start: {up.stderr}\n{pods}")
    # Its admission webhooks answer once their endpoints are there: the
    # queues are applied as soon as the apiserver can call them.
    wait_for(
        "Kueue's webhooks to admit the queues",
        lambda: world.kubectl("apply", "-f", "-", stdin=KUEUE_QUEUES).returncode == 0,
        timeout=120,
        interval=1,
    )
    assert world.kubectl("apply", "-f", "-", stdin=kueue_job("first", 20)).returncode == 0
    wait_for("the first job to be admitted and run", lambda: _job(world, "first")["spec"]["suspend"]
             is False and _job(world, "first").get("status", {}).get("active"),
             timeout=120, interval=1)  # fmt: skip
    assert world.kubectl("apply", "-f", "-", stdin=kueue_job("second", 1)).returncode == 0

    # The quota (8 GPUs) is the first job's while it runs: the second's
    # workload is there but not admitted, and the job stays suspended.
    def second_workload() -> dict[str, Any] | None:
        listed = json.loads(world.kubectl("get", "workloads", "-o", "json").stdout)
        owned = [
            w
            for w in listed["items"]
            if any(o["name"] == "second" for o in w["metadata"].get("ownerReferences", []))
        ]
        return owned[0] if owned else None

    wait_for("the second job's workload", second_workload, timeout=120, interval=1)
    checked = 0
    while not _job(world, "first").get("status", {}).get("succeeded"):
        workload = second_workload()
        assert workload is not None
        admitted = [
            c
            for c in workload.get("status", {}).get("conditions", [])
            if c["type"] in ("QuotaReserved", "Admitted") and c["status"] == "True"
        ]
        assert not admitted, workload["status"]
        assert _job(world, "second")["spec"]["suspend"] is True
        checked += 1
        time.sleep(1)
    assert checked > 0, "the first job finished before the second was checked"
    # Then it runs to completion, after the first.
    done = world.kubectl("wait", "--for=condition=complete", "job/second", "--timeout=180s",
                         timeout=200)  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = _job(world, "first"), _job(world, "second")
    assert first["status"]["succeeded"] == 1
    assert second["status"]["startTime"] >= first["status"]["completionTime"]


# -- SkyPilot -------------------------------------------------------------------

SKY_CLIENT = Path("/var/cache/gpuclusters/skypilot-client")


def _skypilot_wheels() -> Path:
    """SkyPilot's CLI and its dependencies as wheels (the release the pod
    image carries), plus setuptools and wheel: fetched once from PyPI on
    this machine (the laptop reaches no index) and cached."""
    from gpuclusters.imagebuild.catalog import SKYPILOT_VERSION

    wheels = SKY_CLIENT / f"wheels-{SKYPILOT_VERSION}"
    done = wheels / ".complete"  # written last: a directory without it is half-made
    if done.exists():
        return wheels
    shutil.rmtree(wheels, ignore_errors=True)
    subprocess.run(
        [str(PROJECT_ROOT / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "-q",
         "--disable-pip-version-check", "-w", str(wheels),
         f"skypilot[kubernetes]=={SKYPILOT_VERSION}", "setuptools", "wheel"],
        check=True, timeout=900,
    )  # fmt: skip
    done.touch()
    return wheels


def _skypilot_client(laptop: Laptop) -> Path:
    """The user's own virtual environment with SkyPilot's CLI (Debian's
    Python), installed from the wheels with no index, owned by the user:
    SkyPilot changes modes of its own files at run time."""
    from gpuclusters.imagebuild.catalog import SKYPILOT_VERSION

    wheels = _skypilot_wheels()
    venv = laptop.home / "sky"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [str(PROJECT_ROOT / ".venv" / "bin" / "python"), "-m", "pip", "--python",
         str(venv / "bin" / "python"), "install", "-q", "--disable-pip-version-check",
         "--no-index", "--find-links", str(wheels), f"skypilot[kubernetes]=={SKYPILOT_VERSION}"],
        check=True, timeout=600,
    )  # fmt: skip
    subprocess.run(["chown", "-R", f"{laptop.user}:{laptop.user}", str(venv)], check=True)
    return venv


# SkyPilot canonicalises `--gpus H100:8` through its accelerator catalog and
# picks its default image through its image catalog; both are downloaded
# from GitHub unless present, and the laptop has no internet
# (docs/ecosystem/skypilot.md "What the laptop needs").
SKY_CATALOGS = """\
mkdir -p ~/.sky/catalogs/v8/common ~/.sky/catalogs/v8/kubernetes ~/.kube
cp ~/kubeconfig ~/.kube/config
cat > ~/.sky/catalogs/v8/common/accelerators.csv <<'CSV'
AcceleratorName,Clouds
H100,"['Kubernetes']"
CSV
cat > ~/.sky/catalogs/v8/kubernetes/images.csv <<'CSV'
Tag,Region,OS,OSVersion,ImageId,CreationDate
skypilot:custom-cpu-ubuntu-2204-v1,,debian,12,localhost/skypilot:{version},20260101
skypilot:custom-gpu-ubuntu-2204-v1,,debian,12,localhost/skypilot:{version},20260101
CSV
"""


# The task (what the GPUs it was given are) and where it writes that, in the pod.
GPU_TASK = "nvidia-smi -L || echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
GPUS_SEEN = "/tmp/gpc-gpus-seen"


def test_skypilot_launches_a_gpu_task_and_cleans_up(world: World) -> None:
    from gpuclusters.imagebuild.catalog import SKYPILOT_VERSION

    venv = _skypilot_client(world.laptop)
    env = {
        "PATH": f"{venv}/bin:{world.laptop.venv}/bin:/usr/local/bin:/usr/bin:/bin",
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "PIP_NO_INDEX": "1",
        # SkyPilot builds a wheel of itself at every launch (it ships it to
        # the pod); pip's isolated build wants setuptools from an index. An
        # offline laptop points pip at wheels it has (docs/ecosystem/skypilot.md).
        "PIP_FIND_LINKS": str(_skypilot_wheels()),
    }

    def sky(*args: str, timeout: float = 300) -> Any:
        return world.laptop.run("sky", *args, env=env, timeout=timeout)

    world.laptop.run("sh", "-c", SKY_CATALOGS.format(version=SKYPILOT_VERSION), check=True)
    try:
        checked = sky("check", "kubernetes")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert re.search(r"Kubernetes: enabled", checked.stdout), checked.stdout
        # The command; `--cpus 1 --memory 1` because SkyPilot asks
        # 4 CPUs and 16 GB per GPU by default, which the embedded fleet's
        # nodes (this machine's 2 CPUs each) cannot offer.
        launched = sky("launch", "-y", "-c", "gpc", "--infra", "k8s", "--gpus", "H100:8",
                       "--cpus", "1", "--memory", "1", "--",
                       f"{GPU_TASK} | tee {GPUS_SEEN}",
                       timeout=900)  # fmt: skip
        out = launched.stdout + launched.stderr
        assert launched.returncode == 0, out
        assert "Job finished (status: SUCCEEDED)" in out, out
        pods = json.loads(world.kubectl("get", "pods", "-o", "json").stdout)["items"]
        # SkyPilot names what it makes after the cluster: <name>-<hash>-head.
        sky_pods = [p for p in pods if p["metadata"]["name"].startswith("gpc-")]
        assert sky_pods, [p["metadata"]["name"] for p in pods]
        # What the task saw, read from the pod, not from `sky launch`'s
        # streamed output: SkyPilot 0.14.1 can drop a short task's lines from
        # that stream (docs/ecosystem/skypilot.md, "Known limits").
        seen = world.kubectl("exec", sky_pods[0]["metadata"]["name"], "--", "cat", GPUS_SEEN)
        found = re.search(r"CUDA_VISIBLE_DEVICES=([0-9,]+)", seen.stdout)
        assert found, (seen.stdout, seen.stderr, out)
        assert sorted(found[1].split(","), key=int) == [str(i) for i in range(8)], found[0]
        assert all(p["spec"]["containers"][0]["image"] == f"localhost/skypilot:{SKYPILOT_VERSION}"
                   for p in sky_pods)  # fmt: skip
        downed = sky("down", "-y", "gpc")
        assert downed.returncode == 0, downed.stdout + downed.stderr

        def gone() -> bool:
            listed = json.loads(world.kubectl("get", "pods,services", "-o", "json").stdout)
            return not [
                o
                for o in listed["items"]
                if o["metadata"].get("labels", {}).get("skypilot-cluster")
            ]

        wait_for("sky down to delete the pod and its services", gone, timeout=120, interval=1)
    finally:
        sky("down", "-y", "--purge", "gpc")
        sky("api", "stop")
