"""The pieces under the provider that need no namespaces: the subprocess
helper, names and addresses, mountinfo parsing, the state file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from nodetools import host_read, wait_dead

from gpuclusters.linux import layout, sysmount
from gpuclusters.linux.layout import LayoutError, NodeLayout
from gpuclusters.linux.run import CommandError, CommandTimeoutError, run
from gpuclusters.providers.netns.state import NodeRecord, ProviderState


async def test_run_captures_output_and_stdin() -> None:
    done = await run(["sh", "-c", "cat; echo err >&2"], stdin=b"in")
    assert (done.returncode, done.stdout, done.stderr) == (0, b"in", b"err\n")


async def test_run_raises_with_command_and_stderr() -> None:
    with pytest.raises(CommandError) as err:
        await run(["sh", "-c", "echo boom >&2; exit 4"])
    assert err.value.returncode == 4
    assert "boom" in str(err.value) and "sh -c" in str(err.value)
    assert (await run(["false"], check=False)).returncode == 1
    with pytest.raises(CommandError, match="cannot start"):
        await run(["/nonexistent/gpc-program"])


async def test_run_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    start = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        # The grandchild would outlive a plain kill of the shell.
        await run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert wait_dead(int(host_read(str(pidfile)) or b"0"))


async def test_run_passes_only_the_given_environment() -> None:
    done = await run(["/usr/bin/env"], env={"ONLY": "this"})
    assert done.stdout == b"ONLY=this\n"


def test_names_fit_interface_limits() -> None:
    node = NodeLayout("0123456789abcdef0123456789abcdef", Path("/ns"), Path("/home/nodes"))
    assert node.netns == "gpc-0123456789ab"
    assert node.veth == "gpcv01234567" and len(node.veth) <= 15
    assert node.mnt_file == Path("/ns/0123456789abcdef0123456789abcdef.mnt")
    assert layout.bridge_name("fedcba9876543210fedcba9876543210") == "gpcbfedcba98"
    assert layout.gateway(3) == "10.231.3.1"
    assert layout.node_address(255, 10) == "10.231.255.10"
    for bad in ("short", "UPPERCASE0123456", "../../etc/passwd0", "a b c d e f g h i"):
        with pytest.raises(LayoutError):
            NodeLayout(bad, Path("/ns"), Path("/n"))
    with pytest.raises(LayoutError):
        layout.subnet(256)
    with pytest.raises(LayoutError):
        layout.node_address(0, 255)
    assert layout.check_hostname("demo-controller") == "demo-controller"
    for bad in ("", "-x", "x" * 64, "a_b", "a b", "a;b"):
        with pytest.raises(LayoutError):
            layout.check_hostname(bad)


def test_mountinfo_unescapes_paths() -> None:
    assert sysmount._unescape(r"/a\040b\011c\134d") == "/a b\tc\\d"
    assert "/" in sysmount.mount_points()
    assert sysmount.mounts_under(Path("/proc"))[-1] == "/proc"


def record(node_id: str, cluster_id: str, address: str, **kw: str) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        kind="gpu",
        name=node_id[:6],
        hostname=node_id[:6],
        cluster_id=cluster_id,
        cluster_name="c",
        address=address,
        ns_dir="/ns",
        nodes_dir="/nodes",
        **kw,  # type: ignore[arg-type]
    )


def test_state_allocates_lowest_free_and_round_trips(tmp_path: Path) -> None:
    state = ProviderState()
    a, b = "a" * 32, "b" * 32
    net_a = state.allocate_network(a, taken={0, 2})
    net_b = state.allocate_network(b, taken={0, 2})
    assert (net_a and net_a.index, net_b and net_b.index) == (1, 3)
    assert state.allocate_network(a, taken=set()) is net_a  # stable
    assert state.allocate_address(a) == "10.231.1.10"
    state.nodes["1" * 32] = record("1" * 32, a, "10.231.1.10")
    state.nodes["2" * 32] = record("2" * 32, a, "10.231.1.12")
    assert state.allocate_address(a) == "10.231.1.11"  # lowest free
    assert state.prefix_clash("1" * 8 + "f" * 24) is not None  # same veth name
    assert state.prefix_clash("3" * 32) is None
    path = tmp_path / "netns-provider.json"
    state.save(path)
    again = ProviderState.load(path)
    assert again.nodes == state.nodes and again.networks == state.networks
    assert [p.name for p in tmp_path.iterdir()] == ["netns-provider.json"]
    full = ProviderState()
    assert full.allocate_network(a, taken=set(range(256))) is None


def test_state_refuses_unknown_versions(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"version": 99}')
    with pytest.raises(RuntimeError, match="version"):
        ProviderState.load(path)
    assert ProviderState.load(tmp_path / "absent.json").nodes == {}
    assert os.listdir(tmp_path) == ["s.json"]
