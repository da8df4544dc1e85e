"""``gpuclusters hosts add root@HOST``: bootstrap a fresh Debian 12 machine
into a GPU host of the fleet, over SSH, as an operator would by hand
(docs/hosts.md).

Steps, each idempotent (a second run on the same host redoes nothing that
is done, and a failed run can simply be run again):

1. check the machine: Debian 12, root, x86_64, and find its address towards
   the server (``ip route get``) unless ``--address`` says it;
2. packages: ``apt-get install`` of what nodes need (Slurm, munge, MariaDB,
   containerd, runc, CNI plugins, sshd, ...; a no-op when they are there),
   with their own services disabled: gpuclusters starts them inside nodes;
3. the project: a wheelhouse of this gpuclusters and its dependencies, built
   here once (``pip wheel``, cached in ``~/.cache/gpuclusters``) and copied
   over, installed into ``/opt/gpuclusters/venv`` with ``--no-index``: the
   host needs no internet;
4. the Kubernetes node binaries (kubelet, kube-proxy, kubectl) from this
   machine's build cache to the same path there;
5. the node image its nodes boot from (linux/nodeimage.py): this machine's
   newest build, streamed as a tar (numeric owners, extended attributes)
   into the host's image cache under the same key, unless the host has that
   key complete already; the host's own directories are never the nodes';
6. a join token from the server, ``gpuclusters host-agent join`` on the host,
   the systemd unit, and ``systemctl enable --now``;
7. wait until the server shows the host ``ready`` (its first heartbeat).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

import gpuclusters
from gpuclusters.cli.context import (
    OutputFormat,
    OutputOpt,
    api_command,
    open_client,
    stderr_console,
)
from gpuclusters.cli.org import hosts_table
from gpuclusters.cli.render import emit
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.models import check_host_name
from gpuclusters.linux import nodeimage

VENV = "/opt/gpuclusters/venv"
WHEELS = "/opt/gpuclusters/wheels"
UNIT = "gpuclusters-host-agent.service"
K8S_NODE_BINARIES = ("kubelet", "kube-proxy", "kubectl")
DEFAULT_K8S_BIN = Path("/var/cache/gpuclusters/k8s/v1.34.4/bin")
# What nodes use from their host's /usr (Debian 12 package names).
PACKAGES = (
    "python3",
    "python3-venv",
    "iproute2",
    "iptables",
    "conntrack",
    "util-linux",
    "procps",
    "kmod",
    "ca-certificates",
    "slurmd",
    "slurm-client",
    "slurmctld",
    "slurmdbd",
    "munge",
    "mariadb-server",
    "libpmix2",
    "libpam-slurm-adopt",
    "containerd",
    "runc",
    "containernetworking-plugins",
    "busybox-static",
    "iputils-ping",
    "openssh-server",
    "openssh-client",
)
# Installed packages may enable these on the host itself; gpuclusters runs
# them inside nodes only.
HOST_SERVICES_OFF = ("slurmd", "slurmctld", "slurmdbd", "munge", "mariadb", "containerd")

UNIT_TEXT = """[Unit]
Description=gpuclusters host agent
After=network-online.target
Wants=network-online.target

[Service]
ExecStart={venv}/bin/gpuclusters host-agent run --config /etc/gpuclusters/host-agent.json
Restart=always
RestartSec=2
# Nodes' daemons are started by the agent but belong to the nodes: stopping
# or restarting the agent must not kill them.
KillMode=process

[Install]
WantedBy=multi-user.target
"""


class _Remote:
    """Commands on the host over the system's ssh (BatchMode: no prompts)."""

    def __init__(self, target: str, *, key: Path | None, port: int, known_hosts: Path | None):
        self.target = target
        opts = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", str(port)]
        if key is not None:
            opts += ["-i", str(key), "-o", "IdentitiesOnly=yes"]
        if known_hosts is not None:
            opts += ["-o", f"UserKnownHostsFile={known_hosts}"]
        self.opts = opts

    def run(
        self, script: str, *, stdin: bytes | None = None, check: bool = True, timeout: float = 600
    ) -> str:
        argv = ["ssh", *self.opts, self.target, "bash -euo pipefail -c " + shlex.quote(script)]
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
        if check and done.returncode != 0:
            tail = (done.stderr or done.stdout).decode("utf-8", "replace").strip()[-1500:]
            raise ValidationError(f"on {self.target}: command failed ({done.returncode}): {tail}")
        return done.stdout.decode("utf-8", "replace")


def _project_root() -> Path:
    root = Path(gpuclusters.__file__).resolve().parent.parent.parent
    if not (root / "pyproject.toml").exists():
        raise ValidationError(
            "hosts add installs this gpuclusters from its source tree, and none was found "
            f"next to {gpuclusters.__file__}; give --wheelhouse DIR with its wheels"
        )
    return root


def _wheelhouse(given: Path | None) -> Path:
    """A directory of wheels of this gpuclusters and its dependencies, for
    the host's Python (3.11 on Debian 12). The dependencies are cached by
    the project's dependency list; gpuclusters' own wheel is built anew."""
    if given is not None:
        if not any(given.glob("gpuclusters-*.whl")):
            raise ValidationError(f"--wheelhouse {given} holds no gpuclusters wheel")
        return given
    root = _project_root()
    digest = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuclusters"
    out = cache / f"wheelhouse-{digest}"
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(out)]
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([*pip, str(root)], check=True)
        (out / ".complete").write_text("")
    for old in out.glob("gpuclusters-*.whl"):
        old.unlink()
    subprocess.run([*pip, "--no-deps", str(root)], check=True)
    return out


def _ship_node_image(remote: _Remote, image: Path, timeout: float) -> str:
    """The host's path of ``image`` (``<cache>/<key>/rootfs``), copied there
    unless the host has it complete. A copy lands in ``<key>.new`` and is
    renamed, then stamped: an interrupted one is never taken for an image."""
    key = image.parent.name
    cache = shlex.quote(str(nodeimage.DEFAULT_CACHE))
    dest = f"{cache}/{shlex.quote(key)}"
    if remote.run(f"test -e {dest}/.complete && echo have || true", timeout=60).strip() == "have":
        return str(nodeimage.DEFAULT_CACHE / key / "rootfs")
    tar_flags = "--numeric-owner --xattrs --xattrs-include='*'"
    script = (
        f"rm -rf {dest}.new {dest} && mkdir -p {dest}.new/rootfs && "
        f"tar {tar_flags} -C {dest}.new/rootfs -xpf - && mv {dest}.new {dest} && "
        f"date -u +%FT%TZ > {dest}/.complete"
    )
    argv = ["ssh", *remote.opts, remote.target, "bash -euo pipefail -c " + shlex.quote(script)]
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(image), "-cf", "-", "."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        done = subprocess.run(argv, stdin=tar.stdout, capture_output=True, timeout=timeout)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar_err = tar.communicate(timeout=60)[1]
    if tar.returncode != 0 or done.returncode != 0:
        why = (done.stderr or tar_err).decode("utf-8", "replace").strip()[-1500:]
        raise ValidationError(f"on {remote.target}: copying the node image failed: {why}")
    return str(nodeimage.DEFAULT_CACHE / key / "rootfs")


def _node_image_option(value: str | None) -> Path | None:
    """``--node-image``: a built image (default: this machine's newest), or
    ``none`` (the host's nodes then boot from its own directories)."""
    if value is not None and value.strip().lower() in ("", "none"):
        return None
    image = Path(value) if value is not None else nodeimage.newest_built()
    if image is None:
        raise ValidationError(
            f"node_image: no node image built in {nodeimage.DEFAULT_CACHE} "
            "(run scripts/build-node-image, or give --node-image none)",
            field="node_image",
        )
    try:
        nodeimage.check(image)
    except nodeimage.NodeImageError as exc:
        raise ValidationError(f"node_image: {exc}", field="node_image") from exc
    return image


def _tar_of(directory: Path, names: list[str]) -> bytes:
    done = subprocess.run(
        ["tar", "-C", str(directory), "-cf", "-", *names], capture_output=True, check=True
    )
    return done.stdout


@api_command
def hosts_add(
    target: Annotated[str, typer.Argument(help="root@HOST (a fresh Debian 12 machine)")],
    *,
    ssh_key: Annotated[
        Path | None, typer.Option("--ssh-key", help="private key for root on the host")
    ] = None,
    ssh_port: Annotated[int, typer.Option("--ssh-port", min=1, max=65535)] = 22,
    known_hosts: Annotated[
        Path | None, typer.Option("--known-hosts", help="ssh known_hosts file to use")
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="the host's name (default: its hostname)")
    ] = None,
    ib_island: Annotated[
        str | None, typer.Option("--ib-island", help="its InfiniBand island (default: its name)")
    ] = None,
    region: Annotated[str | None, typer.Option("--region")] = None,
    address: Annotated[
        str | None,
        typer.Option("--address", help="its address between hosts (default: its route to us)"),
    ] = None,
    server_url: Annotated[
        str | None,
        typer.Option("--server-url", help="the server's https:// URL as the host reaches it"),
    ] = None,
    volumes_dir: Annotated[
        str | None,
        typer.Option("--volumes-dir", help="the shared filesystem's mount on the host"),
    ] = None,
    home: Annotated[
        str, typer.Option("--home", help="node disks on the host (put it on NVMe)")
    ] = "/var/lib/gpuclusters-host",
    wheelhouse: Annotated[Path | None, typer.Option("--wheelhouse")] = None,
    k8s_bin: Annotated[Path, typer.Option("--k8s-bin")] = DEFAULT_K8S_BIN,
    node_image: Annotated[
        str | None,
        typer.Option(
            "--node-image",
            help="the node image to ship (default: the newest built here; 'none': nodes "
            "see the host's own directories)",
        ),
    ] = None,
    skip_packages: Annotated[
        bool, typer.Option("--skip-packages", help="do not run apt-get (already installed)")
    ] = False,
    timeout_s: Annotated[float, typer.Option("--timeout", min=1)] = 300.0,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Bootstrap a fresh Debian 12 machine into a GPU host of the fleet."""
    err = stderr_console()
    if "@" not in target:
        raise ValidationError(f"target: expected root@HOST, got {target!r}", field="target")
    user, _, hostpart = target.partition("@")
    if user != "root":
        raise ValidationError("target: the host agent is installed as root (root@HOST)")
    image = _node_image_option(node_image)
    remote = _Remote(target, key=ssh_key, port=ssh_port, known_hosts=known_hosts)

    err.print(f"[1/7] checking {hostpart}")
    facts = remote.run(
        '. /etc/os-release; echo "$ID $VERSION_ID"; uname -m; hostname; id -u', timeout=60
    ).split("\n")
    os_id, arch, hostname, uid = facts[0].strip(), facts[1].strip(), facts[2].strip(), facts[3]
    if os_id != "debian 12":
        raise ValidationError(f"target: {hostpart} runs {os_id!r}; hosts must be Debian 12")
    if arch != "x86_64" or uid.strip() != "0":
        raise ValidationError(f"target: {hostpart} is {arch}, uid {uid.strip()}; need x86_64 root")
    host_name = (name or hostname).lower()
    try:
        check_host_name(host_name)
    except ValueError as exc:
        raise ValidationError(f"name: {host_name!r} {exc}; give --name", field="name") from exc

    with open_client() as client:
        token = client.hosts.join_token(host_name, region=region, ib_island=ib_island)
    url = (server_url or token.server_url or "").rstrip("/")
    if not url.startswith("https://"):
        raise ValidationError(
            "the server does not serve TLS; start it with --public-host (or give --server-url)",
            field="server_url",
        )
    if token.ca_fingerprint is None:
        raise ValidationError("the server's CA is the operator's own: not supported by hosts add")
    server_host = urlsplit(url).hostname or ""
    if address is None:
        route = remote.run(f"ip -o route get {shlex.quote(server_host)}", timeout=30)
        words = route.split()
        if "src" not in words:
            raise ValidationError(f"address: no route from {hostpart} to {server_host}")
        address = words[words.index("src") + 1]

    if skip_packages:
        err.print("[2/7] packages: skipped")
    else:
        err.print(f"[2/7] packages ({len(PACKAGES)}, apt-get)")
        remote.run(
            "export DEBIAN_FRONTEND=noninteractive; "
            f"dpkg-query -W {' '.join(PACKAGES)} >/dev/null 2>&1 || "
            f"{{ apt-get update -q && apt-get install -y -q --no-install-recommends "
            f"{' '.join(PACKAGES)}; }}; "
            f"systemctl disable --now {' '.join(HOST_SERVICES_OFF)} >/dev/null 2>&1 || true",
            timeout=1800,
        )

    err.print("[3/7] gpuclusters and its dependencies")
    wheels = _wheelhouse(wheelhouse)
    names = sorted(p.name for p in wheels.glob("*.whl"))
    remote.run(
        f"rm -rf {WHEELS}.new && mkdir -p {WHEELS}.new && tar -C {WHEELS}.new -xf - && "
        f"rm -rf {WHEELS} && mv {WHEELS}.new {WHEELS} && "
        f"{{ [ -x {VENV}/bin/python ] || python3 -m venv {VENV}; }} && "
        f"{VENV}/bin/pip install --quiet --no-index --find-links {WHEELS} --force-reinstall "
        "--no-deps gpuclusters && "
        f"{VENV}/bin/pip install --quiet --no-index --find-links {WHEELS} gpuclusters",
        stdin=_tar_of(wheels, names),
        timeout=1800,
    )

    err.print("[4/7] Kubernetes node binaries")
    missing = [b for b in K8S_NODE_BINARIES if not (k8s_bin / b).exists()]
    if missing:
        raise ValidationError(
            f"k8s_bin: {k8s_bin} lacks {', '.join(missing)} (run scripts/build-k8s)",
            field="k8s_bin",
        )
    have = remote.run(
        f"cd {shlex.quote(str(k8s_bin))} 2>/dev/null && sha256sum {' '.join(K8S_NODE_BINARIES)}"
        " || true",
        timeout=120,
    )
    local = subprocess.run(
        ["sha256sum", *K8S_NODE_BINARIES], cwd=k8s_bin, capture_output=True, check=True
    ).stdout.decode()
    if have.strip() != local.strip():
        remote.run(
            f"mkdir -p {shlex.quote(str(k8s_bin))} && tar -C {shlex.quote(str(k8s_bin))} -xf -",
            stdin=_tar_of(k8s_bin, list(K8S_NODE_BINARIES)),
            timeout=1800,
        )

    if image is None:
        err.print("[5/7] node image: none (nodes see the host's own directories)")
        host_image = None
    else:
        err.print(f"[5/7] node image {image.parent.name}")
        host_image = _ship_node_image(remote, image, timeout=1800)

    err.print(f"[6/7] joining {host_name} ({address}) to {url}")
    join = [
        f"{VENV}/bin/gpuclusters",
        "host-agent",
        "join",
        "--server",
        url,
        "--token",
        token.token,
        "--name",
        host_name,
        "--address",
        address,
        "--ca-fingerprint",
        token.ca_fingerprint,
        "--home",
        home,
    ]
    if volumes_dir is not None:
        join += ["--volumes-dir", volumes_dir]
    if host_image is not None:
        join += ["--node-image", host_image]
    unit = UNIT_TEXT.format(venv=VENV)
    remote.run(
        f"{shlex.join(join)} && cat > /etc/systemd/system/{UNIT} && systemctl daemon-reload && "
        f"systemctl enable {UNIT} >/dev/null 2>&1 && systemctl restart {UNIT}",
        stdin=unit.encode(),
        timeout=120,
    )

    err.print(f"[7/7] waiting for {host_name}'s first heartbeat")
    deadline = time.monotonic() + timeout_s
    with open_client() as client:
        while True:
            host = client.hosts.get(host_name)
            if host.agent_status is not None and host.agent_status.value == "ready":
                break
            if time.monotonic() > deadline:
                tail = remote.run(f"journalctl -u {UNIT} -n 30 --no-pager", check=False)
                raise ValidationError(
                    f"host {host_name} did not report within {timeout_s:.0f}s "
                    f"(agent: {host.agent_status}); its agent's log:\n{tail}"
                )
            time.sleep(1)
    emit(output, host, render=lambda: hosts_table([host]))
