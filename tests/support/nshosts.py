"""GPU hosts for tests, made of namespaces on this machine: each host is a
network namespace on an "underlay" bridge plus a mount namespace of its own
(with /sys of its netns), held by a ``sleep`` that stands for the host's
init, and runs its own ``gpuclusters host-agent``, which the server reaches
only over the underlay, with mutual TLS.

Killing a host's agent leaves the host (its namespaces, and so its nodes)
up, as on a real machine; ``close`` stops the agents and removes every
namespace, link and mount a host made, nodes included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from support.processes import clean_env, console_script

AGENT_PORT = 8471


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


@dataclass
class NsHost:
    name: str
    address: str
    netns: str
    veth: str
    home: Path
    ns_dir: Path
    init: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)

    @property
    def config(self) -> Path:
        return self.home / "host-agent.json"

    def enter(self) -> list[str]:
        """A command line prefix that runs inside this host (its network and
        mount namespaces)."""
        assert self.init is not None
        return ["nsenter", "-t", str(self.init.pid), "--net", "--mount", "--"]

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return sh(*self.enter(), *argv, check=check, timeout=timeout)

    def gpuclusters(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.enter(), *console_script(), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_env(),
            check=False,
        )


class NsHosts:
    """``with NsHosts(root, subnet_index=1) as lab: lab.add("gpu-a")``."""

    def __init__(self, root: Path, *, subnet_index: int, route_to: list[str]) -> None:
        self.root = root
        self.prefix = f"10.232.{subnet_index}"
        self.bridge = f"gpcul{subnet_index}"
        self.gateway = f"{self.prefix}.1"
        self.route_to = route_to
        self.hosts: list[NsHost] = []
        self._bridge_made = False

    def __enter__(self) -> NsHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        if shutil.which("nsenter") is None:
            raise RuntimeError("nsenter is needed")
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            raise RuntimeError(f"{self.bridge} exists: another lab uses this subnet")
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> NsHost:
        n = len(self.hosts) + 2
        tag = f"{self.bridge[-1]}{n}"
        host = NsHost(
            name=name,
            address=f"{self.prefix}.{n}",
            netns=f"gpch-{name}",
            veth=f"gpchv{tag}",
            home=self.root / name,
            ns_dir=Path(f"/run/gpuclusters/test-hosts/{name}/ns"),
        )
        host.home.mkdir(parents=True, exist_ok=True)
        host.log = self.root / f"{name}-agent.log"
        self.hosts.append(host)
        sh("ip", "netns", "add", host.netns)
        sh(
            "ip",
            "link",
            "add",
            host.veth,
            "type",
            "veth",
            "peer",
            "name",
            "gpchp",
            "netns",
            host.netns,
        )
        sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
        sh("ip", "-n", host.netns, "link", "set", "gpchp", "name", "eth0")
        sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        for dest in self.route_to:
            sh("ip", "-n", host.netns, "route", "add", f"{dest}/32", "via", self.gateway)
        # The host's "init": a mount namespace of its own with a sysfs of
        # the host's netns (what the node code reads links from), and the
        # machine's cgroup hierarchies under it (`ip netns exec` would hide
        # them, and kubelet and containerd need them).
        keep = f"/run/gpuclusters/test-hosts/{name}/cgroup"
        init = (
            f"mkdir -p {keep} && mount --rbind /sys/fs/cgroup {keep} && umount -l /sys && "
            f"mount -t sysfs sysfs /sys && mount --rbind {keep} /sys/fs/cgroup && "
            f"umount -l {keep} && exec sleep infinity"
        )
        enter_netns = ["nsenter", f"--net=/run/netns/{host.netns}"]
        host.init = subprocess.Popen(
            [*enter_netns, "unshare", "--mount", "--propagation", "slave", "sh", "-c", init],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while Path(f"/proc/{host.init.pid}/comm").read_text().strip() != "sleep":
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {name}'s init did not start")
            time.sleep(0.02)
        return host

    def join(
        self, host: NsHost, *, server_url: str, token: str, ca_file: Path, volumes_dir: Path
    ) -> None:
        done = host.gpuclusters(
            "host-agent", "join", "--server", server_url, "--token", token,
            "--name", host.name, "--address", host.address, "--ca-file", str(ca_file),
            "--home", str(host.home), "--ns-dir", str(host.ns_dir),
            "--volumes-dir", str(volumes_dir), "--config", str(host.config),
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"join of {host.name} failed: {done.stdout}{done.stderr}")
        cfg = json.loads(host.config.read_text())
        cfg["heartbeat_interval_s"] = 1.0
        host.config.write_text(json.dumps(cfg))

    def start_agent(self, host: NsHost) -> None:
        assert host.agent is None or host.agent.poll() is not None
        with open(host.log, "ab") as log:
            host.agent = subprocess.Popen(
                [
                    *host.enter(),
                    *console_script(),
                    "host-agent",
                    "run",
                    "--config",
                    str(host.config),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                start_new_session=True,
            )

    def kill_agent(self, host: NsHost) -> None:
        if host.agent is not None and host.agent.poll() is None:
            os.killpg(host.agent.pid, signal.SIGKILL)
            host.agent.wait(timeout=10)

    def stop_agent(self, host: NsHost) -> None:
        if host.agent is not None and host.agent.poll() is None:
            host.agent.send_signal(signal.SIGTERM)
            try:
                host.agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill_agent(host)

    def leftovers(self, host: NsHost) -> list[str]:
        """What of nodes a host still has: VXLAN devices, cluster bridges,
        node network namespaces, pinned namespaces."""
        found: list[str] = []
        links = json.loads(host.run("ip", "-j", "link", "show").stdout or "[]")
        found += [
            f"link {link['ifname']}"
            for link in links
            if str(link["ifname"]).startswith(("gpcx", "gpcb", "gpcv"))
        ]
        mounts = host.run("cat", "/proc/self/mounts").stdout
        found += [
            f"mount {line.split()[1]}"
            for line in mounts.splitlines()
            if line.split()[1].startswith((f"{host.ns_dir}/", "/run/netns/gpc-"))
        ]
        return found

    def node_logs(self, host: NsHost, tail: int = 40) -> str:
        """The tails of the gpuclusters logs inside every node of ``host``
        (for failure messages)."""
        out = []
        for mnt in sorted(host.ns_dir.glob("*.mnt")) if host.init else []:
            done = host.run(
                "nsenter", f"--mount={mnt}", "sh", "-c",
                f"for f in /var/log/gpuclusters/*.log; do echo \"== $f\"; tail -n {tail} $f; done",
                check=False,
            )  # fmt: skip
            out.append(f"=== {host.name} {mnt.stem}\n{done.stdout}{done.stderr}")
        return "\n".join(out)

    def _destroy_nodes(self, host: NsHost) -> None:
        """Safety net: remove nodes a failed test left, with the host's own
        provider (the agent is stopped by then)."""
        state = host.home / "netns-provider.json"
        if not state.exists() or not json.loads(state.read_text()).get("nodes"):
            return
        script = (
            "import asyncio, pathlib, sys\n"
            "from gpuclusters.hostagent.config import AgentConfig\n"
            "from gpuclusters.hostagent.main import make_provider\n"
            "cfg = AgentConfig.load(pathlib.Path(sys.argv[1]))\n"
            "async def main():\n"
            "    p = make_provider(cfg, {})\n"
            "    for i in await p.list_instances():\n"
            "        await p.delete(i.node_id)\n"
            "    await p.close()\n"
            "asyncio.run(main())\n"
        )
        import sys

        sh(*host.enter(), sys.executable, "-c", script, str(host.config), check=False, timeout=120)

    def close(self) -> None:
        for host in self.hosts:
            self.stop_agent(host)
            if host.init is not None and host.init.poll() is None:
                with contextlib.suppress(Exception):
                    self._destroy_nodes(host)
                host.init.kill()
                host.init.wait(timeout=10)
            sh("ip", "link", "del", host.veth, check=False)
            for pid in sh("ip", "netns", "pids", host.netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", host.netns, check=False)
            shutil.rmtree(host.ns_dir.parent, ignore_errors=True)
        self.hosts.clear()
        if self._bridge_made:
            sh("ip", "link", "del", self.bridge, check=False)
            self._bridge_made = False


@contextlib.contextmanager
def ns_hosts(root: Path, *, subnet_index: int, route_to: list[str]) -> Iterator[NsHosts]:
    lab = NsHosts(root, subnet_index=subnet_index, route_to=route_to)
    try:
        lab.up()
        yield lab
    finally:
        lab.close()
