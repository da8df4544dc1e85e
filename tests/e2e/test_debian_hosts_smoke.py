"""The Debian host harness (tests/support/debian_hosts.py) gives what tests of
"real machines" rely on: two fresh Debian 12 hosts with their own hostnames,
machine ids and SSH host keys, reachable from each other over the underlay,
where root can do what our nodes do (network namespaces, veth, VXLAN,
unshare, overlay/tmpfs/bind mounts, iptables, cgroups, the namespace's own
sysctls), with the operator's shared filesystem, the baked packages (their
`apt-get install` is a no-op offline), and a teardown that leaves nothing
behind on this machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support.debian_hosts import DebianHost, DebianHosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="booting hosts needs root"),
    pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs Debian (apt, mmdebstrap)"),
]

SUBNET = "10.232.7.0/24"
BRIDGE = "gpcul7"
HOST_LINK = re.compile(rf"^(gpcv[0-9a-f]{{6}}|{BRIDGE})$")


def _snapshot(workdir: Path) -> dict[str, set[str]]:
    """What a leaked host would leave on this machine: the harness's
    namespaces and links, mounts of its directories, nspawn processes and
    anything in a host's cgroup. (Only those: other tests may run beside
    this one and change the rest.)"""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    procs = set()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            comm = (pid_dir / "comm").read_text().strip()
            cgroup = (pid_dir / "cgroup").read_text()
        except OSError:
            continue
        if comm == "systemd-nspawn" or "/gpch-" in cgroup:
            procs.add(f"{pid_dir.name} {comm}")
    link_names = {ln.split(":")[1].strip().split("@")[0] for ln in links.stdout.splitlines()}
    return {
        "netns": {ln.split()[0] for ln in netns.stdout.splitlines() if ln.startswith("gpch-")},
        "links": {name for name in link_names if HOST_LINK.match(name)},
        "mounts": {
            ln
            for ln in Path("/proc/mounts").read_text().splitlines()
            if str(workdir) in ln or "gpch-" in ln or "nspawn" in ln
        },
        "processes": procs,
        "cgroups": {str(p) for p in Path("/sys/fs/cgroup").glob("*/gpch-*")},
    }


def _checks_as_root(host: DebianHost) -> str:
    """What our nodes do as root on a host; `set -e`: the first failure stops."""
    return f"""
set -eux
ip netns add gpc-x
ip link add v0 type veth peer name v1
ip link set v1 netns gpc-x
ip link add br-x type bridge
ip link add vx0 type vxlan id 42 local {host.address} dstport 4789
ip -n gpc-x link set lo up
unshare --mount --uts --net true
unshare --pid --fork --mount-proc true
mkdir -p /run/t && mount -t tmpfs tmpfs /run/t
mkdir -p /run/t/l /run/t/u /run/t/w /run/t/m && echo lower >/run/t/l/f
mount -t overlay overlay -o lowerdir=/run/t/l,upperdir=/run/t/u,workdir=/run/t/w /run/t/m
grep -qx lower /run/t/m/f
c=/var/lib/containerd/ov && mkdir -p $c/u $c/w $c/m
mount -t overlay overlay -o lowerdir=/usr,upperdir=$c/u,workdir=$c/w $c/m
test -x $c/m/bin/true
mkdir -p /run/b && mount --bind /etc /run/b && test -f /run/b/hostname
iptables -t nat -A POSTROUTING -s 10.99.0.0/24 -j MASQUERADE
iptables -t nat -S POSTROUTING | grep -q 10.99.0.0/24
echo 1 >/proc/sys/net/ipv4/ip_forward
ip netns exec gpc-x sh -c 'echo 1 >/proc/sys/net/ipv4/ip_forward'
test -c /dev/net/tun
for c in memory cpu pids; do mkdir /sys/fs/cgroup/$c/gpc-test; done
echo 64 >/sys/fs/cgroup/pids/gpc-test/pids.max
sh -c 'echo $$ >/sys/fs/cgroup/pids/gpc-test/cgroup.procs && grep pids:/gpc-test /proc/self/cgroup'
echo all-ok
"""


def test_two_debian_hosts(tmp_path: Path) -> None:
    before = _snapshot(tmp_path)
    shared = tmp_path / "shared"
    started = time.monotonic()
    with DebianHosts(tmp_path / "lab", subnet=SUBNET, bridge=BRIDGE, shared_dir=shared) as lab:
        h1, h2 = lab.boot(["gpu-a", "gpu-b"])
        boot_s = time.monotonic() - started
        print(f"boot to SSH: {h1.boot_seconds:.1f}s, {h2.boot_seconds:.1f}s (all: {boot_s:.1f}s)")

        # Own hostnames and machine ids; systemd came up without failures.
        for host in (h1, h2):
            assert host.run("hostname", check=True).stdout.strip() == host.name
            state = host.run("systemctl is-system-running --wait; systemctl --failed --no-legend")
            assert state.stdout.startswith("running"), state.stdout
        ids = {h.run("cat /etc/machine-id", check=True).stdout.strip() for h in (h1, h2)}
        assert len(ids) == 2 and "" not in ids

        # Each host made its own SSH host keys at first boot, and presents them.
        keys = [h.run("cat /etc/ssh/ssh_host_ed25519_key.pub", check=True).stdout for h in (h1, h2)]
        assert keys[0].split()[1] != keys[1].split()[1]
        known = lab.known_hosts.read_text()
        for host, key in zip((h1, h2), keys, strict=True):
            assert f"{host.address} ssh-ed25519 {key.split()[1]}" in known

        # The underlay: host to host (and names from /etc/hosts).
        h1.run(f"ping -c1 -W2 {h2.address} && ping -c1 -W2 {h2.name}", check=True)

        # Root inside a host: namespaces, links, mounts, iptables, sysctls, cgroups.
        for host in (h1, h2):
            assert host.run(_checks_as_root(host), check=True).stdout.strip().endswith("all-ok")

        # VXLAN between the hosts over the underlay carries traffic.
        for me, peer, inner in ((h1, h2, "192.168.77.1"), (h2, h1, "192.168.77.2")):
            me.run(
                f"ip link add vx1 type vxlan id 77 local {me.address} remote {peer.address} "
                f"dstport 4789 dev eth0 && ip addr add {inner}/24 dev vx1 && ip link set vx1 up",
                check=True,
            )
        h1.run("ping -c1 -W3 192.168.77.2", check=True)

        # The shared filesystem: written on one host, read on the other.
        h1.run("echo from-a >/mnt/gpc-shared/hello", check=True)
        assert h2.run("cat /mnt/gpc-shared/hello", check=True).stdout == "from-a\n"
        assert (shared / "hello").read_text() == "from-a\n"

        # The baked packages: the agent's install is a no-op, with no way out.
        apt = h2.run(
            "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
            "$(cat /etc/gpuclusters-host-packages)",
            check=True,
        )
        assert "0 newly installed" in apt.stdout, apt.stdout

    after = _snapshot(tmp_path)
    for what in before:
        assert not after[what] - before[what], (
            f"{what} left behind: {sorted(after[what] - before[what])}; "
            f"gone: {sorted(before[what] - after[what])}"
        )
    assert not list((tmp_path / "lab").glob("*-gpu-*")), "per-host directories left behind"
