"""Users reach their clusters from their own machines (docs/access.md).

Everything user-facing here runs as a user would: on a "laptop" (its own
network namespace, reaching the server machine only through a veth to the
gateway address), as a fresh non-root Unix account with no rights on the
server machine, with the CLI from its own virtual environment and the
system's ``ssh`` and ``kubectl``. Only the operator's steps (starting the
server, issuing API keys) run as root on the server machine.

One Slurm cluster serves the whole module (it takes ~10 s to make); the
tests run in file order and build on each other: login over TLS, a cluster
created from the laptop, SSH with a certificate and with a registered key,
compute nodes through the login node only with a job there, kubectl through
the gateway, another project's user refused, revocations within 60 s, and
egress (NAT, switchable) with clusters still isolated from each other.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netlab import Laptop, Outside, sh

from gpuclusters.layers import ssh as ssh_layer
from gpuclusters.providers.netns.state import ProviderState
from gpuclusters.server.services.tenancy import ADMIN_USER
from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
    pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="run scripts/setup first"),
]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
REVOKE_WITHIN_S = 60.0
HELLO = "hello from outside"
SSH_OPTS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10"]


class World:
    """What the module's tests share."""

    def __init__(self, server: ServerHandle, laptop: Laptop, outside: Outside) -> None:
        self.server = server
        self.laptop = laptop
        self.outside = outside
        self.cluster: dict[str, Any] = {}
        self.keys: dict[str, str] = {}

    # -- the operator, on the server machine ----------------------------------

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

    # -- the user, on the laptop ------------------------------------------------

    def cli(self, *args: str, home: str = ".gpuclusters", timeout: float = 180) -> Any:
        return self.laptop.run(
            "gpuclusters", *args, env={"GPUCLUSTERS_HOME": f"{self.laptop.home}/{home}"},
            timeout=timeout,
        )  # fmt: skip

    def ok(self, *args: str, home: str = ".gpuclusters", timeout: float = 180) -> str:
        r = self.cli(*args, home=home, timeout=timeout)
        assert r.returncode == 0, f"laptop: gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def ssh(self, user: str, key: str, *cmd: str) -> Any:
        """Plain OpenSSH with a key file, as in the README: the host is
        trusted through ~/.ssh/known_hosts, which `ssh-keys add` gave the
        gateway's @cert-authority line (StrictHostKeyChecking=yes: no
        question would be answered)."""
        endpoint = self.cluster["ssh_endpoint"]
        return self.laptop.run(
            "ssh", *SSH_OPTS, "-o", "IdentitiesOnly=yes", "-i", key,
            "-p", str(endpoint["port"]), f"{user}@{endpoint['host']}", *cmd,
            timeout=60,
        )  # fmt: skip


@pytest.fixture(scope="module")
def world(module_servers: Servers) -> Iterator[World]:
    laptop = Laptop(PROJECT_ROOT)
    outside = Outside(HELLO)
    try:
        laptop.up()
        outside.up()
        server = module_servers(provider="netns", start=False, public_host=laptop.gateway)
        server.env["GPUCLUSTERS_TLS"] = "on"
        server.env["GPUCLUSTERS_TLS_PORT"] = str(free_port())
        server.env["GPUCLUSTERS_ACCESS_SYNC_INTERVAL_S"] = "5"
        server.start()
        yield World(server, laptop, outside)
    finally:
        module_servers.close()  # before the laptop's network goes
        laptop.close()
        outside.close()


def test_login_over_tls_from_the_laptop(world: World) -> None:
    laptop = world.laptop
    key = world.api_key("alice", "default", "admin")
    # The operator hands the CA file (printed fingerprint, README) to users.
    ca = world.server.home / "tls" / "ca.pem"
    (laptop.home / "ca.pem").write_bytes(ca.read_bytes())
    port = world.server.env["GPUCLUSTERS_TLS_PORT"]
    url = f"https://{laptop.gateway}:{port}"
    # Without the CA the laptop does not trust the server, and writes nothing.
    refused = world.cli("login", "--url", url, "--api-key", key)
    assert refused.returncode != 0
    assert not (laptop.home / ".gpuclusters" / "config.toml").exists()
    out = world.ok(
        "login", "--url", url, "--api-key", key, "--ca-file", f"{laptop.home}/ca.pem",
        "--output", "json",
    )  # fmt: skip
    assert json.loads(out)["user"] == "alice"
    # The laptop cannot reach the plain-HTTP listener (localhost of the server).
    assert world.cli("whoami", "--output", "json").returncode == 0


def test_create_a_cluster_from_the_laptop(world: World) -> None:
    out = world.ok(
        "clusters", "create", "demo", "--type", "slurm", "--gpus", "16", "--wait",
        "--output", "json",
    )  # fmt: skip
    cluster = json.loads(out)
    assert cluster["status"] == "ready"
    assert cluster["ssh_endpoint"]["host"] == world.laptop.gateway
    assert cluster["kubernetes_endpoint"].startswith(f"https://{world.laptop.gateway}:")
    assert cluster["egress"] is True
    world.cluster = cluster


def test_clusters_ssh_uses_a_certificate_without_a_registered_key(world: World) -> None:
    assert json.loads(world.ok("ssh-keys", "list", "--output", "json")) == []
    out = world.ok("clusters", "ssh", "demo", "--", "id", "-un")
    assert out.strip() == "alice"
    # The host was verified through the organization's host CA (no prompt,
    # StrictHostKeyChecking=yes) and the CLI wrote that trust down.
    known = (world.laptop.home / ".gpuclusters" / "known_hosts").read_text()
    assert "@cert-authority" in known


def test_plain_ssh_with_a_registered_key_runs_slurm(world: World) -> None:
    laptop = world.laptop
    laptop.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
               f"{laptop.home}/.ssh/id_ed25519", check=True)  # fmt: skip
    world.ok("ssh-keys", "add", f"{laptop.home}/.ssh/id_ed25519.pub")
    key = f"{laptop.home}/.ssh/id_ed25519"
    world.keys["alice"] = key
    # One remote command line, as ssh sends it to the login shell.
    sinfo = world.ssh("alice", key, "sinfo -N -h -o '%N %T %G'")
    assert sinfo.returncode == 0, sinfo.stderr
    lines = sorted(sinfo.stdout.split("\n"))
    rows = [line.split() for line in lines if line.strip()]
    assert len(rows) == 2 and all(r[1] == "idle" and r[2] == "gpu:8" for r in rows), rows
    job = world.ssh("alice", key, "sbatch", "--wait", "-N2", "--gres=gpu:8",
                    "-o", "/mnt/shared/hosts.txt", "--wrap", "'srun hostname'")  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    hosts = world.ssh("alice", key, "cat", "/mnt/shared/hosts.txt")
    names = sorted(n["name"] for n in world.cluster["nodes"])
    assert sorted(hosts.stdout.split()) == names
    # The same through the CLI (certificate), as in the README.
    srun = world.ok("clusters", "ssh", "demo", "--", "sbatch", "--wait", "-N2",
                    "--gres=gpu:8", "--wrap", "srun hostname")  # fmt: skip
    assert "Submitted batch job" in srun


def test_compute_nodes_admit_only_users_with_a_job_there(world: World) -> None:
    busy, idle = sorted(n["name"] for n in world.cluster["nodes"])
    refused = world.cli("clusters", "ssh", "demo", "--node", busy, "--", "hostname")
    assert refused.returncode != 0
    world.ok("clusters", "ssh", "demo", "--", "sbatch", "-N1", "-w", busy, "-o", "/dev/null",
             "--wrap", "sleep 300")  # fmt: skip
    # The job's extern step is there once the job runs.
    deadline = time.monotonic() + 60
    while True:
        inside = world.cli("clusters", "ssh", "demo", "--node", busy, "--", "hostname")
        if inside.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == busy
    other = world.cli("clusters", "ssh", "demo", "--node", idle, "--", "hostname")
    assert other.returncode != 0
    world.ok("clusters", "ssh", "demo", "--", "scancel", "-u", "alice")


def test_kubectl_through_the_gateway(world: World) -> None:
    laptop = world.laptop
    world.ok("clusters", "credentials", "demo", "--file", f"{laptop.home}/kubeconfig")
    kc = ["--kubeconfig", f"{laptop.home}/kubeconfig"]
    config = laptop.run("kubectl", *kc, "config", "view", "--minify", "-o", "json", check=True)
    cluster = json.loads(config.stdout)["clusters"][0]["cluster"]
    assert cluster["server"] == world.cluster["kubernetes_endpoint"]
    assert "insecure-skip-tls-verify" not in cluster
    nodes = json.loads(laptop.run("kubectl", *kc, "get", "nodes", "-o", "json", check=True).stdout)
    ready = [
        n["metadata"]["name"]
        for n in nodes["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
    ]
    assert len(ready) == 2
    job = f"""
apiVersion: batch/v1
kind: Job
metadata: {{name: fetch}}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: fetch
        image: localhost/gpuclusters-base:latest
        command: ["wget", "-q", "-O", "-", "{world.outside.url()}"]
"""
    laptop.run("kubectl", *kc, "apply", "-f", "-", stdin=job, check=True)
    done = laptop.run("kubectl", *kc, "wait", "--for=condition=complete", "job/fetch",
                      "--timeout=120s", timeout=150)  # fmt: skip
    if done.returncode != 0:
        pods = laptop.run("kubectl", *kc, "describe", "pods", "-l", "job-name=fetch")
        logs = laptop.run("kubectl", *kc, "logs", "job/fetch")
        pytest.fail(f"job fetch did not complete: {done.stderr}\n{pods.stdout}\n{logs.stdout}"
                    f"{logs.stderr}")  # fmt: skip
    logs = laptop.run("kubectl", *kc, "logs", "job/fetch", check=True)
    assert logs.stdout.strip() == HELLO  # the pod reached "the internet" (egress)


def test_another_projects_user_is_refused(world: World) -> None:
    world.admin("projects", "create", "other")
    key = world.api_key("bob", "other", "admin")
    world.ok("login", "--url", _tls_url(world), "--api-key", key, "--ca-file",
             f"{world.laptop.home}/ca.pem", home=".bob")  # fmt: skip
    assert world.cli("clusters", "get", "demo", "--project", "default", home=".bob").returncode
    assert world.cli("clusters", "ssh", "demo", "--project", "default", "--", "id",
                     home=".bob").returncode  # fmt: skip
    # Bob's own key (registered for bob) does not open alice's cluster.
    laptop = world.laptop
    laptop.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{laptop.home}/bob_key",
               check=True)  # fmt: skip
    world.ok("ssh-keys", "add", f"{laptop.home}/bob_key.pub", home=".bob")
    _wait_synced(world)
    refused = world.ssh("bob", f"{laptop.home}/bob_key", "id")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr


def test_revocations_stop_new_logins_within_a_minute(world: World) -> None:
    laptop = world.laptop
    # A member with a key logs in; removing the membership stops it.
    key = world.api_key("carol", "default", "editor")
    world.ok("login", "--url", _tls_url(world), "--api-key", key, "--ca-file",
             f"{laptop.home}/ca.pem", home=".carol")  # fmt: skip
    laptop.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{laptop.home}/carol_key",
               check=True)  # fmt: skip
    world.ok("ssh-keys", "add", f"{laptop.home}/carol_key.pub", home=".carol")
    _until_login(world, "carol", f"{laptop.home}/carol_key", works=True)
    kubeconfig = f"{laptop.home}/carol.kubeconfig"
    world.ok("clusters", "credentials", "demo", "--file", kubeconfig, home=".carol")
    pods = ["kubectl", "--kubeconfig", kubeconfig, "get", "pods"]
    assert laptop.run(*pods).returncode == 0
    # A token she holds already (tokens last 5 minutes).
    token = json.loads(world.ok("clusters", "token", "demo", home=".carol"))["status"]["token"]
    world.admin("projects", "members", "remove", "carol", "--project", "default")
    _until_login(world, "carol", f"{laptop.home}/carol_key", works=False)
    # Her kubeconfig gets no token any more: the next kubectl run is refused.
    refused = laptop.run(*pods)
    assert refused.returncode != 0 and "not found" in refused.stderr, refused.stderr
    # And the token she held authorizes nothing: her RBAC binding is gone.
    held = [*pods, "--token", token]
    _until(lambda: "Forbidden" in laptop.run(*held).stderr, timeout=REVOKE_WITHIN_S)
    # A deleted SSH key is refused; the user's certificate path still works.
    keys = json.loads(world.ok("ssh-keys", "list", "--output", "json"))
    world.ok("ssh-keys", "delete", keys[0]["id"])
    _until_login(world, "alice", world.keys["alice"], works=False)
    assert world.ok("clusters", "ssh", "demo", "--", "id", "-un").strip() == "alice"
    # A deleted user: certificates are no longer issued and the account's
    # principals are gone from the nodes (each node's sshd reads them there).
    nodes = [n["name"] for n in world.cluster["nodes"]]

    def principal_files() -> list[str]:
        probe = f"test -e {ssh_layer.PRINCIPALS_DIR}/alice && echo present || echo absent"
        return [
            world.admin("clusters", "ssh", "demo", "--as-root", "--node", node, "--",
                        "sh", "-c", probe).strip()
            for node in nodes
        ]  # fmt: skip

    assert principal_files() == ["present"] * len(nodes)  # so the check below can fail
    world.admin("users", "delete", "alice")
    assert world.cli("clusters", "ssh", "demo", "--", "id").returncode != 0
    _until(lambda: principal_files() == ["absent"] * len(nodes), timeout=REVOKE_WITHIN_S)


def test_egress_is_switchable_and_clusters_stay_isolated(world: World) -> None:
    url = world.outside.url()
    fetch = ["python3", "-c",
             f"import urllib.request; print(urllib.request.urlopen('{url}', timeout=5).read().decode())"]  # fmt: skip  # noqa: E501
    job = world.admin("clusters", "ssh", "demo", "--", "srun", "-N1", *fetch)
    assert job.strip() == HELLO
    world.admin("clusters", "configure", "demo", "--no-egress")
    _until(lambda: world.server.cli("clusters", "ssh", "demo", "--", *fetch).returncode != 0)
    world.admin("clusters", "configure", "demo", "--egress")
    _until(lambda: world.server.cli("clusters", "ssh", "demo", "--", *fetch).returncode == 0)
    # A second cluster: no TCP connection between the two, in either direction.
    other = json.loads(world.admin(
        "clusters", "create", "iso", "--type", "kubernetes", "--gpus", "8", "--wait",
        "--output", "json",
    ))  # fmt: skip
    assert other["status"] == "ready"
    iso_node = _node_address(world, "iso", other["nodes"][0]["name"])
    demo_node = _node_address(world, "demo", world.cluster["nodes"][0]["name"])
    probe = "import socket,sys; socket.create_connection((sys.argv[1], 10250), 3)"
    across = world.server.cli("clusters", "ssh", "demo", "--as-root", "--node",
                              world.cluster["nodes"][0]["name"], "--", "python3", "-c", probe,
                              iso_node)  # fmt: skip
    assert across.returncode != 0, "a node reached another cluster's node"
    # The kubelet there does listen: its own cluster reaches it.
    assert world.server.cli("clusters", "ssh", "iso", "--as-root", "--", "python3", "-c", probe,
                            iso_node).returncode == 0  # fmt: skip
    back = world.server.cli("clusters", "ssh", "iso", "--as-root", "--", "python3", "-c", probe,
                            demo_node)  # fmt: skip
    assert back.returncode != 0
    # Nor does the laptop reach nodes except through the gateway's ports.
    direct = world.laptop.run("python3", "-c", probe, demo_node)
    assert direct.returncode != 0
    # Nodes cannot open connections to the server machine's own sockets:
    # the TLS API listens on every address, the laptop reaches it, a node
    # (through its default gateway, the host's bridge address) does not.
    tls_port = world.server.env["GPUCLUSTERS_TLS_PORT"]
    to_host = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3)"
    bridge = world.admin("clusters", "ssh", "demo", "--as-root", "--", "sh", "-c",
                         "ip -4 route show default | cut -d' ' -f3").strip()  # fmt: skip
    assert bridge.startswith("10.231."), bridge
    for address in (bridge, world.laptop.gateway):
        blocked = world.server.cli("clusters", "ssh", "demo", "--as-root", "--", "python3", "-c",
                                   to_host, address, tls_port)  # fmt: skip
        assert blocked.returncode != 0, f"a node reached the server's API at {address}"
    assert world.laptop.run("python3", "-c", to_host, world.laptop.gateway,
                            tls_port).returncode == 0  # fmt: skip


def test_an_org_admin_forces_a_delete_from_the_laptop(world: World) -> None:
    """``clusters delete --force --reason`` as users run it: from the laptop,
    over TLS, as a non-root account. A project admin is refused and nothing
    changes; the organization's admin forces it, the reason is kept on the
    cluster, and the delete finishes with nothing of the cluster left."""
    state = ProviderState.load(world.server.home / "netns-provider.json")
    iso = json.loads(world.admin("clusters", "get", "iso", "--output", "json"))
    names = {n["name"] for n in iso["nodes"]}
    netns = {r.layout.netns for r in state.nodes.values() if r.name in names}
    assert netns and netns <= _netns_present()  # so the check at the end can fail
    ca = f"{world.laptop.home}/ca.pem"
    for user, home in (("erin", ".erin"), (ADMIN_USER, ".orgadmin")):
        key = world.api_key(user, "default", "admin")
        world.ok("login", "--url", _tls_url(world), "--api-key", key, "--ca-file", ca, home=home)
    refused = world.cli("clusters", "delete", "iso", "--force", "--reason", "stuck", home=".erin")
    assert refused.returncode != 0 and "admin" in refused.stderr, refused.stderr
    unchanged = json.loads(world.admin("clusters", "get", "iso", "--output", "json"))
    assert unchanged["status"] == "ready" and unchanged["force_delete_reason"] is None
    forced = json.loads(world.ok(
        "clusters", "delete", "iso", "--force", "--reason", "host pulled for repair",
        "--output", "json", home=".orgadmin",
    ))  # fmt: skip
    assert forced["status"] == "deleting"
    assert forced["force_delete_reason"] == f"by {ADMIN_USER}: host pulled for repair"
    world.ok("clusters", "delete", "iso", "--wait", home=".orgadmin", timeout=300)
    gone = world.cli("clusters", "get", "iso", home=".orgadmin")
    assert gone.returncode != 0 and "not found" in gone.stderr.lower(), gone.stderr
    assert not netns & _netns_present()


# -- helpers -----------------------------------------------------------------


def _tls_url(world: World) -> str:
    return f"https://{world.laptop.gateway}:{world.server.env['GPUCLUSTERS_TLS_PORT']}"


def _until(check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(1)


def _until_login(world: World, user: str, key: str, *, works: bool) -> None:
    """Poll plain SSH until it works (or is refused); a revocation must take
    effect within a minute."""
    start = time.monotonic()
    while True:
        r = world.ssh(user, key, "true")
        if (r.returncode == 0) == works:
            return
        elapsed = time.monotonic() - start
        assert elapsed < REVOKE_WITHIN_S, (
            f"ssh as {user} still {'refused' if works else 'accepted'} after {elapsed:.0f}s: "
            f"{r.stderr}"
        )
        time.sleep(1)


def _wait_synced(world: World) -> None:
    # The access sync runs at once on a hint; give it a pass to finish.
    deadline = time.monotonic() + 30
    while "access of cluster demo updated" not in world.server.log:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def _netns_present() -> set[str]:
    listed = sh("ip", "netns", "list").stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _node_address(world: World, cluster: str, node: str) -> str:
    out = world.admin("clusters", "ssh", cluster, "--as-root", "--node", node, "--",
                      "hostname", "-I")  # fmt: skip
    return out.split()[0]


def test_no_laptop_leftovers_on_the_server_machine() -> None:
    # Runs last in the module: the laptop fixture is gone by then only after
    # the module ends, so this only checks that nothing of ours is routed to
    # the pool from the host's main table by mistake.
    routes = sh("ip", "-4", "route", "show").stdout
    assert "10.230." not in "".join(r for r in routes.splitlines() if "linkdown" in r)
