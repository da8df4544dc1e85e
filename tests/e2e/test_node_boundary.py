"""A node is a boundary: attacks from inside a cluster, as its users would
make them, and what each one reaches (docs/security.md).

The users work from the "laptop" (own network namespace, a non-root Unix
account, the CLI, ``kubectl`` and ``ssh``), as in test_remote_access.py.
The project editor is named like the laptop's Unix account, so the host
has an account of the same name (with a password hash): the case where
every cluster of a project failed with "account ... exists with uid ...".

Every attack is first made against the host itself (as root on the server
machine), where it reaches what it is after, so each test fails if the
node boundary is absent. Nodes run in user namespaces (the default): a
privileged pod's root is nobody on the host, and may not open the host's
disk, write its sysctls or mount cgroup hierarchies.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netlab import Laptop

from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
    pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="run scripts/setup first"),
]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SSH_OPTS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10"]
# What the attacking pods and jobs print, between markers.
PROBE = (
    "echo '== shadow'; cat {root}/etc/shadow; "
    "echo '== vartmp'; ls -A {root}/var/tmp; "
    "echo '== home'; ls -A {root}{home}; "
    "echo '== scratch'; ls -A {root}/scratch; "
    "echo '== end'"
)


def sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("== "):
            name = line[3:].strip()
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    assert "end" in out, text
    return out


def host(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


class World:
    def __init__(self, server: ServerHandle, laptop: Laptop) -> None:
        self.server = server
        self.laptop = laptop
        self.cluster: dict[str, Any] = {}
        self.marker = f"gpc-host-secret-{secrets.token_hex(4)}"
        self.pw_hash = f"$6$gpcattack${secrets.token_hex(16)}"
        self.kc = ["--kubeconfig", f"{laptop.home}/kubeconfig"]

    def admin(self, *args: str, timeout: float = 240) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def ok(self, *args: str, timeout: float = 240) -> str:
        r = self.laptop.run(
            "gpuclusters", *args, env={"GPUCLUSTERS_HOME": f"{self.laptop.home}/.gpuclusters"},
            timeout=timeout,
        )  # fmt: skip
        assert r.returncode == 0, f"laptop: gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 150) -> Any:
        return self.laptop.run("kubectl", *self.kc, *args, stdin=stdin, timeout=timeout)

    def node_dir(self, name: str) -> Path:
        """The node's directory on the host (found by the hostname its
        /etc upper layer holds)."""
        for d in (self.server.home / "nodes").iterdir():
            hostname = d / "upper" / "etc" / "hostname"
            if hostname.exists() and hostname.read_text().strip() == name:
                return d
        raise AssertionError(f"no node directory for {name}")


@pytest.fixture(scope="module")
def world(module_servers: Servers) -> Iterator[World]:
    laptop = Laptop(PROJECT_ROOT)
    try:
        laptop.up()
        server = module_servers(provider="netns", start=False, public_host=laptop.gateway)
        server.env["GPUCLUSTERS_TLS"] = "on"
        # Nodes in user namespaces (the default; said here because this
        # suite is about them, whatever the machine's environment holds).
        server.env["GPUCLUSTERS_NODE_USERNS"] = "1"
        server.env["GPUCLUSTERS_TLS_PORT"] = str(free_port())
        server.start()
        w = World(server, laptop)
        # The host's secrets: the laptop account's password hash (the account
        # the project editor shares a name with) and a file in /var/tmp.
        subprocess.run(["usermod", "-p", w.pw_hash, laptop.user], check=True)
        Path("/var/tmp", w.marker).write_text("host data\n")
        yield w
    finally:
        for leftover in Path("/var/tmp").glob("gpc-host-secret-*"):
            leftover.unlink()
        module_servers.close()
        laptop.close()


def test_a_member_named_like_a_host_account_gets_a_cluster(world: World) -> None:
    """The editor is the laptop account's namesake: a host account with
    another uid. The cluster still becomes ready, with the project's uid."""
    laptop = world.laptop
    assert host("id", "-u", laptop.user).returncode == 0  # the host has that account
    created = world.admin("api-keys", "create", "--user", laptop.user, "--project", "default",
                          "--role", "editor", "--output", "json")  # fmt: skip
    key = json.loads(created)["key"]
    ca = world.server.home / "tls" / "ca.pem"
    (laptop.home / "ca.pem").write_bytes(ca.read_bytes())
    url = f"https://{laptop.gateway}:{world.server.env['GPUCLUSTERS_TLS_PORT']}"
    world.ok("login", "--url", url, "--api-key", key, "--ca-file", f"{laptop.home}/ca.pem")
    out = world.admin("clusters", "create", "sec", "--type", "slurm", "--gpus", "16", "--wait",
                      "--output", "json", timeout=300)  # fmt: skip
    world.cluster = json.loads(out)
    assert world.cluster["status"] == "ready"
    uid = world.ok("clusters", "ssh", "sec", "--", "id", "-u").strip()
    assert uid != host("id", "-u", laptop.user).stdout.strip()
    assert int(uid) >= 10000
    world.ok("clusters", "credentials", "sec", "--file", f"{laptop.home}/kubeconfig")
    can = world.kubectl("auth", "can-i", "create", "pods")
    assert can.stdout.strip() == "yes", can.stderr  # the editor may run pods


def sbatch(world: World, job: str) -> None:
    """Submit a one-node job as the editor over SSH and wait for it (the CLI
    quotes each argument for the remote shell)."""
    r = world.laptop.run(
        "gpuclusters", "clusters", "ssh", "sec", "--", "sbatch", "--wait", "-N1",
        "-o", "/mnt/shared/job-%j.out", "--wrap", job,
        env={"GPUCLUSTERS_HOME": f"{world.laptop.home}/.gpuclusters"}, timeout=240,
    )  # fmt: skip
    if r.returncode != 0:
        out = world.ok("clusters", "ssh", "sec", "--", "sh", "-c", "cat /mnt/shared/job-*.out")
        pytest.fail(f"job failed: {r.stdout}{r.stderr}\njob output:\n{out}")


def _pod(name: str, spec: str) -> str:
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  restartPolicy: Never
{spec}"""


def run_pod(world: World, name: str, spec: str) -> str:
    """Apply a pod (as the editor, from the laptop), wait for it to finish,
    return its log."""
    applied = world.kubectl("apply", "-f", "-", stdin=_pod(name, spec))
    assert applied.returncode == 0, applied.stderr
    deadline = time.monotonic() + 120
    phase = ""
    while time.monotonic() < deadline:
        got = world.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}")
        phase = got.stdout.strip()
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    logs = world.kubectl("logs", name)
    assert phase == "Succeeded", f"{name}: {phase}\n{logs.stdout}{logs.stderr}"
    return str(logs.stdout)


def test_privileged_host_pid_pod_enters_its_node_not_the_host(world: World) -> None:
    """nsenter -t 1 from a privileged hostPID pod: PID 1 is the node's init;
    its namespaces are the node's: the node's accounts, /var and processes."""
    home = str(world.server.home)
    # Every process's whole command line from /proc: the same in the
    # node's image (BusyBox ps) and on the host, and never cut at COLUMNS
    # (procps' ps cut a long checkout path before " server --provider").
    probe = PROBE.format(root="", home=home) + (
        "; echo '== ps'; for c in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $c; echo; done"
        "; echo '== end'"
    )
    spec = f"""  hostPID: true
  containers:
  - name: escape
    image: localhost/gpuclusters-base:latest
    securityContext: {{privileged: true}}
    command: {
        json.dumps(["nsenter", "-t", "1", "-m", "-u", "-n", "-i", "-p", "--", "sh", "-c", probe])
    }
"""
    # Against the host itself: a hostPID pod on a node without a PID
    # namespace saw the server's process and entered its namespaces (the
    # attack of issue 24); there it gets the hash, the file, the server's
    # home and the server process.
    server_pid = world.server.proc.pid if world.server.proc else 0
    on_host = sections(host("nsenter", "-t", str(server_pid), "-m", "-u", "-n", "-i", "-p",
                            "--", "sh", "-c", probe).stdout)  # fmt: skip
    assert world.pw_hash in on_host["shadow"]
    assert world.marker in on_host["vartmp"]
    assert "config.toml" in on_host["home"]
    assert "gpuclusters server" in on_host["ps"] or " server --provider" in on_host["ps"]
    seen = sections(run_pod(world, "escape-pid", spec))
    assert world.pw_hash not in seen["shadow"] and world.laptop.user + ":$" not in seen["shadow"]
    assert world.marker not in seen["vartmp"]
    assert "config.toml" not in seen["home"]
    assert "server --provider" not in seen["ps"]
    assert "_nsinit" in seen["ps"]  # PID 1 there is the node's init
    assert seen["ps"].count("slurmd") <= 1, seen["ps"]  # not the other node's


def test_host_path_root_pod_sees_its_node_not_the_host(world: World) -> None:
    """hostPath / is the node's root: not the host's shadow, /var/tmp, the
    server's home, nor another node's /scratch."""
    names = sorted(n["name"] for n in world.cluster["nodes"])
    mine, other = names
    other_scratch = world.node_dir(other) / "scratch" / "other-node-secret"
    other_scratch.write_text("x\n")
    home = str(world.server.home)
    # The host's own root has all of it (what hostPath / gave before).
    on_host = sections(host("sh", "-c", PROBE.format(root="", home=home)).stdout)
    assert world.pw_hash in on_host["shadow"] and world.marker in on_host["vartmp"]
    assert "config.toml" in on_host["home"]
    assert other_scratch.exists()
    probe = PROBE.format(root="/host", home=home)
    spec = f"""  nodeName: {mine}
  containers:
  - name: look
    image: localhost/gpuclusters-base:latest
    securityContext: {{privileged: true}}
    command: ["sh", "-c", {json.dumps(probe)}]
    volumeMounts: [{{name: root, mountPath: /host}}]
  volumes: [{{name: root, hostPath: {{path: /}}}}]
"""
    seen = sections(run_pod(world, "look-root", spec))
    assert world.pw_hash not in seen["shadow"]
    assert world.marker not in seen["vartmp"]
    assert "config.toml" not in seen["home"]
    assert "other-node-secret" not in seen["scratch"]


# What only real root may do, tried in turn; each line says "ok" or
# "refused". {dev}: the host root filesystem's block device (major minor).
ROOT_ONLY = (
    "cd {tmp}; "
    "echo '== disk'; (mknod disk b {dev} && echo ok) 2>/dev/null || echo refused; rm -f disk; "
    "echo '== sysctl'; (cat /proc/sys/kernel/panic > /proc/sys/kernel/panic && echo ok) 2>/dev/null"
    " || echo refused; "
    "echo '== hierarchy'; mkdir -p cg; (mount -t cgroup -o none,name=gpcattack cgroup cg"
    " && echo ok && umount cg) 2>/dev/null || echo refused; "
    "echo '== end'"
)


def test_a_privileged_pod_is_nobody_on_the_host(world: World, tmp_path: Path) -> None:
    """Root in a privileged pod is the first id of the project's block on
    the host (the node's user namespace): it may not open the host's disk,
    write a host sysctl or mount a cgroup hierarchy (the release_agent
    escape). Each works as root on the host. (Loading a kernel module is
    covered in tests/linux/test_userns.py: this kernel has no modules.)"""
    st = os.stat("/")
    dev = f"{os.major(st.st_dev)} {os.minor(st.st_dev)}"
    on_host = sections(host("sh", "-c", ROOT_ONLY.format(tmp=tmp_path, dev=dev)).stdout)
    # (This machine's sandbox then refuses to open the device even to host
    # root; on a host, mknod is the step that gives the disk away.)
    assert on_host["disk"].strip() == "ok"
    assert on_host["sysctl"].strip() == "ok"
    assert on_host["hierarchy"].strip() == "ok"
    probe = ROOT_ONLY.format(tmp="/tmp", dev=dev) + "; exec sleep 6017"
    spec = f"""  containers:
  - name: root
    image: localhost/gpuclusters-base:latest
    securityContext: {{privileged: true}}
    command: ["sh", "-c", {json.dumps(probe)}]
"""
    applied = world.kubectl("apply", "-f", "-", stdin=_pod("root-only", spec))
    assert applied.returncode == 0, applied.stderr
    logs = ""
    deadline = time.monotonic() + 120
    while "== end" not in logs and time.monotonic() < deadline:
        time.sleep(1)
        logs = str(world.kubectl("logs", "root-only").stdout)
    seen = sections(logs)
    assert seen["disk"].strip() == "refused"
    assert seen["sysctl"].strip() == "refused"
    assert seen["hierarchy"].strip() == "refused"
    # The pod's process, seen from the host: the block's first id.
    projects = json.loads(world.admin("projects", "list", "--output", "json"))
    first = next(p["host_ids"]["first"] for p in projects if p["name"] == "default")
    pids = host("pgrep", "-f", "-x", "sleep 6017").stdout.split()
    assert pids, "the pod's process is not running"
    uids = {_status_uid(int(pid)) for pid in pids}
    assert uids == {first}, (uids, first)
    world.kubectl("delete", "pod", "root-only", "--wait=false")


def _status_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def test_a_slurm_job_sees_and_signals_its_node_only(world: World) -> None:
    """A user's Slurm job, submitted over SSH from the laptop: ps -e shows
    its node's processes only, and the server process cannot be signalled."""
    server_pid = world.server.proc.pid if world.server.proc else 0
    assert server_pid and host("kill", "-0", str(server_pid)).returncode == 0
    all_slurmd = host("pgrep", "-c", "-x", "slurmd").stdout.strip()
    assert int(all_slurmd or 0) >= 2  # the host sees both nodes' slurmd
    # On the host, the laptop's user sees the server's process (signalling
    # it is refused, not "no such process").
    as_user = host("runuser", "-u", world.laptop.user, "--", "sh", "-c", f"kill -0 {server_pid}")
    assert as_user.returncode != 0 and "No such process" not in as_user.stderr, as_user
    job = (
        f"ps -eo pid=,args= > /mnt/shared/ps.txt; kill -0 {server_pid} 2> /mnt/shared/kill.txt;"
        " echo $? >> /mnt/shared/kill.txt"
    )
    sbatch(world, job)
    listed = world.ok("clusters", "ssh", "sec", "--", "cat", "/mnt/shared/ps.txt")
    assert "server --provider" not in listed
    daemons = [line.split(None, 1)[1].split()[0] for line in listed.splitlines() if line.strip()]
    assert daemons.count("slurmd") == 1, listed  # its own, not the other node's
    pids = [int(line.split()[0]) for line in listed.splitlines() if line.strip()]
    assert 1 in pids and max(pids) < 1000, listed
    killed = world.ok("clusters", "ssh", "sec", "--", "cat", "/mnt/shared/kill.txt")
    assert killed.strip().splitlines()[-1] != "0", killed
    assert "No such process" in killed, killed
    assert host("kill", "-0", str(server_pid)).returncode == 0


def test_nodes_cannot_reach_the_servers_ports(world: World) -> None:
    """The server's API over TLS answers the laptop but not a node."""
    port = world.server.env["GPUCLUSTERS_TLS_PORT"]
    target = f"/dev/tcp/{world.laptop.gateway}/{port}"
    from_laptop = world.laptop.run("bash", "-c", f"exec 3<>{target}", timeout=20)
    assert from_laptop.returncode == 0, from_laptop.stderr
    job = f"timeout 5 bash -c 'exec 3<>{target}'; echo $? > /mnt/shared/connect.txt"
    sbatch(world, job)
    rc = world.ok("clusters", "ssh", "sec", "--", "cat", "/mnt/shared/connect.txt")
    assert rc.strip() != "0", rc
