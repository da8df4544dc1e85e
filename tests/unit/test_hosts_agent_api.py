"""The host agent's API (``hostagent/api.py``) driven by the server's own
client code (``providers/hosts/agent_client.py``, ``shell.py``) in-process:
the agent's provider is a stub that records what it is asked, and the
client's HTTPS connection is swapped for an ASGI transport into the agent's
app. What is checked is the contract between the two sides: every call
arrives with its arguments, bytes survive the base64 round trip, and the
agent's errors become the same provider errors on the server's side."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import pytest

from gpuclusters.core.nodeshell import CommandResult, NodeCommandError
from gpuclusters.hostagent.api import make_app
from gpuclusters.providers.base import (
    Instance,
    InstanceState,
    NodeSpec,
    PermanentProviderError,
    ProviderError,
)
from gpuclusters.providers.hosts import wire
from gpuclusters.providers.hosts.agent_client import AgentClient
from gpuclusters.providers.hosts.shell import RemoteShell
from gpuclusters.providers.netns.provider import NetnsNodeProvider

HOST = "gpu-a1"
LOCAL = "10.9.8.7"
ALL_BYTES = bytes(range(256))


@dataclass
class StubShell:
    hostname: str = "n1"
    address: str = "10.231.0.5"
    python: str = "/opt/gpuclusters/venv/bin/python"
    calls: list[tuple[str, Any]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    daemons: set[str] = field(default_factory=set)
    result: CommandResult = field(default_factory=lambda: CommandResult(0, "", ""))
    fail_spawn: bool = False

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        self.calls.append(
            ("run", {"argv": list(argv), "user": user, "env": env, "stdin": stdin,
                     "timeout_s": timeout_s, "check": check})
        )  # fmt: skip
        return self.result

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        self.calls.append(("spawn", (name, list(argv), env)))
        if self.fail_spawn:
            raise NodeCommandError(self.hostname, argv, CommandResult(3, "", "no such binary"))
        self.daemons.add(name)

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        self.calls.append(("stop", (name, timeout_s)))
        self.daemons.discard(name)

    async def is_running(self, name: str) -> bool:
        return name in self.daemons

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        self.calls.append(("write_file", (path, mode, owner)))
        changed = self.files.get(path) != data
        self.files[path] = data
        return changed

    async def read_file(self, path: str) -> bytes | None:
        return self.files.get(path)

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        return ["nsenter", "-t", "4242", "-a", *argv]


@dataclass
class StubProvider:
    """The few ``NetnsNodeProvider`` methods the agent's API calls."""

    shell_: StubShell = field(default_factory=StubShell)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    instances: dict[str, Instance] = field(default_factory=dict)
    raise_on_status: Exception | None = None

    async def ensure_segment(self, **kw: Any) -> None:
        self.calls.append(("ensure_segment", kw))

    async def forget_network(self, cluster_id: str) -> None:
        self.calls.append(("forget_network", cluster_id))

    async def list_instances(self) -> list[Instance]:
        return sorted(self.instances.values(), key=lambda i: i.node_id)

    async def create_at(self, spec: NodeSpec, *, address: str | None) -> Instance:
        self.calls.append(("create_at", (spec, address)))
        if spec.gpu_type == "NOPE":
            raise PermanentProviderError(f"unsupported GPU type {spec.gpu_type}")
        if spec.gpu_type == "BAD":
            raise ValueError("gpu_type: not a catalog type")
        inst = Instance(node_id=spec.node_id, host=spec.host, state=InstanceState.BOOTING)
        self.instances[spec.node_id] = inst
        return inst

    async def status(self, node_id: str) -> Instance:
        if self.raise_on_status is not None:
            raise self.raise_on_status
        return self.instances.get(node_id) or Instance(node_id, "", InstanceState.MISSING)

    async def delete(self, node_id: str) -> None:
        self.calls.append(("delete", node_id))
        self.instances.pop(node_id, None)

    async def reboot(self, node_id: str) -> Instance:
        self.calls.append(("reboot", node_id))
        return Instance(node_id, HOST, InstanceState.BOOTING, "rebooted")

    async def reprovision(self, node_id: str) -> Instance:
        self.calls.append(("reprovision", node_id))
        return Instance(node_id, HOST, InstanceState.BOOTING, "reprovisioned")

    async def shell(self, node_id: str) -> StubShell:
        if node_id not in self.instances:
            raise PermanentProviderError(f"no node {node_id}")
        return self.shell_


@pytest.fixture
def provider() -> StubProvider:
    return StubProvider()


@pytest.fixture
async def client(provider: StubProvider) -> AsyncIterator[AgentClient]:
    async def inventory() -> dict[str, Any]:
        return {"gpu_count": 0, "simulated_gpu_type": "H100_SXM"}

    app = make_app(
        cast(NetnsNodeProvider, provider),
        host_name=HOST,
        local_address=LOCAL,
        inventory=inventory,
    )
    c = AgentClient(host=HOST, address=LOCAL, port=8471, ctx=ssl.create_default_context())
    await c.close()
    c._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=f"https://{LOCAL}:8471"
    )
    yield c
    await c.close()


def _node(gpu_type: str = "H100_SXM") -> wire.NodeCreate:
    return wire.NodeCreate(
        name="demo-node-1",
        cluster_id="c1",
        cluster_name="demo",
        gpu_type=gpu_type,
        compute_class="standard",
        address="10.231.0.5",
        volume_id="v1",
        labels={"role": "gpu"},
    )


async def _shell(client: AgentClient, node_id: str = "n1") -> RemoteShell:
    info = await client.shell_info(node_id)
    return RemoteShell(
        client,
        node_id,
        hostname=info.hostname,
        address=info.address,
        enter=info.enter,
        python=info.python,
    )


async def test_info_segments_and_nodes(client: AgentClient, provider: StubProvider) -> None:
    assert await client.info() == {
        "name": HOST,
        "address": LOCAL,
        "inventory": {"gpu_count": 0, "simulated_gpu_type": "H100_SXM"},
    }

    segment = wire.Segment(
        index=3,
        vni=0x10003,
        peers=["10.0.0.1", LOCAL, "10.0.0.2"],
        mtu=1450,
        names={"demo-node-1": "10.231.3.5"},
        egress=False,
    )
    await client.put_segment("c1", segment)
    await client.delete_segment("c1")
    assert provider.calls == [
        (
            "ensure_segment",
            {
                "cluster_id": "c1",
                "index": 3,
                "vni": 0x10003,
                "local": LOCAL,  # this host's address is its VTEP...
                "peers": {"10.0.0.1", "10.0.0.2"},  # ...and never its own peer
                "mtu": 1450,
                "names": {"demo-node-1": "10.231.3.5"},
                "egress": False,
            },
        ),
        ("forget_network", "c1"),
    ]
    provider.calls.clear()

    out = await client.put_node("n1", _node())
    assert (out.node_id, out.host, out.state) == ("n1", HOST, "booting")
    [(what, (spec, address))] = provider.calls
    assert what == "create_at" and address == "10.231.0.5"
    assert spec == NodeSpec(
        node_id="n1",
        name="demo-node-1",
        cluster_id="c1",
        cluster_name="demo",
        host=HOST,  # the agent's own name, whatever the caller thinks
        gpu_type="H100_SXM",
        compute_class="standard",
        volume_id="v1",
        labels={"role": "gpu"},
    )
    provider.instances["n0"] = Instance("n0", HOST, InstanceState.RUNNING)
    assert [(i.node_id, i.state) for i in await client.nodes()] == [
        ("n0", "running"),
        ("n1", "booting"),
    ]
    assert (await client.node("n0")).state == "running"
    assert (await client.node("gone")).state == "missing"
    out = await client.restart("n0", reprovision=False)
    assert (out.state, out.message) == ("booting", "rebooted")
    out = await client.restart("n0", reprovision=True)
    assert out.message == "reprovisioned"
    await client.delete_node("n1")
    assert provider.calls[1:] == [("reboot", "n0"), ("reprovision", "n0"), ("delete", "n1")]
    assert [i.node_id for i in await client.nodes()] == ["n0"]


async def test_agent_errors_become_the_same_provider_errors(
    client: AgentClient, provider: StubProvider
) -> None:
    with pytest.raises(PermanentProviderError, match=r"host gpu-a1: unsupported GPU type NOPE"):
        await client.put_node("n1", _node("NOPE"))
    # Bad input the agent refuses (ValueError) is permanent too: retrying cannot help.
    with pytest.raises(PermanentProviderError, match="not a catalog type"):
        await client.put_node("n1", _node("BAD"))

    provider.instances["n1"] = Instance("n1", HOST, InstanceState.RUNNING)
    provider.raise_on_status = ProviderError("netns state file is locked")
    with pytest.raises(ProviderError, match="host gpu-a1: netns state file is locked") as info:
        await client.node("n1")
    assert not isinstance(info.value, PermanentProviderError)

    # A command failing inside the agent is transient.
    provider.shell_.fail_spawn = True
    with pytest.raises(ProviderError, match="no such binary") as info:
        await client.spawn("n1", wire.Spawn(name="slurmd", argv=["slurmd", "-D"]))
    assert not isinstance(info.value, PermanentProviderError)

    # A shell on a node the agent does not have.
    with pytest.raises(PermanentProviderError, match="no node ghost"):
        await client.shell_info("ghost")

    # An answer that is not the agent's error body (an unknown route: an
    # agent of another version) is transient, with the body in the message.
    with pytest.raises(ProviderError, match="Not Found") as info:
        await client._call("GET", "/v1/nowhere")
    assert not isinstance(info.value, PermanentProviderError)


async def test_an_agent_that_cannot_be_reached_is_a_transient_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    c = AgentClient(host=HOST, address=LOCAL, port=8471, ctx=ssl.create_default_context())
    await c.close()
    c._http = httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="https://x")
    try:
        with pytest.raises(ProviderError, match="gpu-a1: agent unreachable") as info:
            await c.node("n1")
        assert not isinstance(info.value, PermanentProviderError)
    finally:
        await c.close()


async def test_remote_shell_round_trips_bytes(client: AgentClient, provider: StubProvider) -> None:
    provider.instances["n1"] = Instance("n1", HOST, InstanceState.RUNNING)
    sh = await _shell(client)
    assert (sh.hostname, sh.address, sh.python) == ("n1", "10.231.0.5", provider.shell_.python)

    text_out, text_err = "héllo ✓\n\x00tab\t", "wärning\n"
    provider.shell_.result = CommandResult(0, text_out, text_err)
    done = await sh.run(
        ["cat"], user="alice", env={"A": "1"}, stdin=ALL_BYTES, timeout_s=7.5, check=True
    )
    assert done == CommandResult(0, text_out, text_err)
    [(what, call)] = provider.shell_.calls
    assert what == "run"
    assert call == {
        "argv": ["cat"],
        "user": "alice",
        "env": {"A": "1"},
        "stdin": ALL_BYTES,  # every byte value arrives as it was sent
        "timeout_s": 7.5,
        "check": False,  # the agent never raises for an exit code: the client decides
    }
    await sh.run(["true"])
    assert provider.shell_.calls[-1][1]["stdin"] is None

    assert await sh.write_file("/etc/blob", ALL_BYTES, mode=0o600, owner="slurm") is True
    assert provider.shell_.files["/etc/blob"] == ALL_BYTES
    assert provider.shell_.calls[-1] == ("write_file", ("/etc/blob", 0o600, "slurm"))
    assert await sh.write_file("/etc/blob", ALL_BYTES, mode=0o600, owner="slurm") is False
    assert await sh.write_file("/etc/empty", b"") is True
    assert await sh.read_file("/etc/blob") == ALL_BYTES
    assert await sh.read_file("/etc/empty") == b""
    assert await sh.read_file("/etc/missing") is None

    assert await sh.is_running("slurmd") is False
    await sh.spawn("slurmd", ["slurmd", "-D"], env={"X": "y"})
    assert await sh.is_running("slurmd") is True
    await sh.stop("slurmd", timeout_s=4)
    assert await sh.is_running("slurmd") is False
    assert ("spawn", ("slurmd", ["slurmd", "-D"], {"X": "y"})) in provider.shell_.calls
    assert ("stop", ("slurmd", 4.0)) in provider.shell_.calls

    # An operator's terminal: root SSH to the host, then the agent's nsenter line.
    assert sh.exec_argv(["bash", "-l"], user="alice") == [
        "ssh",
        "-t",
        f"root@{LOCAL}",
        "--",
        "nsenter -t 4242 -a runuser -u alice -- bash -l",
    ]


async def test_remote_shell_check_raises_on_a_non_zero_exit(
    client: AgentClient, provider: StubProvider
) -> None:
    provider.instances["n1"] = Instance("n1", HOST, InstanceState.RUNNING)
    sh = await _shell(client)
    provider.shell_.result = CommandResult(2, "partial out", "sinfo: error: no controller\n")
    with pytest.raises(NodeCommandError, match="sinfo: error: no controller") as info:
        await sh.run(["sinfo"])
    assert info.value.node == "n1" and info.value.argv == ["sinfo"]
    assert info.value.result == CommandResult(2, "partial out", "sinfo: error: no controller\n")
    done = await sh.run(["sinfo"], check=False)
    assert done.returncode == 2 and done.stdout == "partial out"


async def test_node_metrics_pass_through_from_the_nodes_own_address(
    client: AgentClient, provider: StubProvider
) -> None:
    """The database's scrape of a node on a host: the agent fetches the node
    agent's /metrics at the node's address from its own state."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    Gauge("DCGM_FI_DEV_GPU_UTIL", "util", ["gpu"], registry=registry).labels("0").set(42)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_address[1]
    try:
        provider.shell_.address = "127.0.0.1"
        provider.instances["n1"] = Instance("n1", HOST, InstanceState.RUNNING)
        http = client._http
        r = await http.get("/v1/nodes/n1/metrics", params={"port": port})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 42.0' in r.text
        # A node this host does not have: nothing is fetched.
        assert (await http.get("/v1/nodes/n9/metrics", params={"port": port})).status_code == 409
        bad = await http.get("/v1/nodes/n1/metrics", params={"port": 0})
        assert bad.status_code == 422
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    # The node agent does not answer: a 502 (the target is down).
    down = await client._http.get("/v1/nodes/n1/metrics", params={"port": port})
    assert down.status_code == 502 and down.json()["code"] == "transient"
