"""The node agent's Kubernetes device plugin, against a fake kubelet.

The fake kubelet is a real gRPC ``Registration`` server on ``kubelet.sock`` in
a temporary device-plugin directory; the tests then talk to the plugin's
socket the way kubelet does. GPUs are ``SimulatedGpus`` over a temporary
/dev holding plain files ``nvidia0``..``nvidia7`` (a GPU is present while its
file exists). Intervals are milliseconds; every wait is a poll with a timeout.
"""

from __future__ import annotations

import json
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuclusters.agent import __main__ as agent_main
from gpuclusters.agent import gpus as gpus_mod
from gpuclusters.agent.deviceplugin import api_pb2 as pb
from gpuclusters.agent.deviceplugin import api_pb2_grpc as pb_grpc
from gpuclusters.agent.deviceplugin import plugin as plugin_mod
from gpuclusters.agent.deviceplugin.plugin import DevicePluginRunner, GpuDevicePlugin, NodeDevices
from gpuclusters.agent.gpus import GpuInfo, SimulatedGpus
from gpuclusters.linux import nodeimage
from gpuclusters.linux.devices import DeviceSet
from gpuclusters.providers.base import HostSpec
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.netns.state import ClusterNetwork, NodeRecord

TIMEOUT_S = 10.0
UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class FakeKubelet(pb_grpc.RegistrationServicer):
    """kubelet's Registration service; records every RegisterRequest."""

    def __init__(self, sock: Path, *, fail_first: int = 0) -> None:
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.fail_first = fail_first
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        sock.unlink(missing_ok=True)
        self.server.add_insecure_port(f"unix://{sock}")
        self.server.start()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.calls += 1
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is not ready")
        self.requests.put(request)
        return pb.Empty()

    def next_registration(self) -> pb.RegisterRequest:
        return self.requests.get(timeout=TIMEOUT_S)

    def stop(self) -> None:
        self.server.stop(grace=None).wait(TIMEOUT_S)


@dataclass
class Node:
    plugin_dir: Path
    dev_dir: Path
    gpus: SimulatedGpus

    @property
    def kubelet_sock(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    def runner(self) -> DevicePluginRunner:
        return DevicePluginRunner(
            self.gpus,
            plugin_dir=self.plugin_dir,
            socket_name="gpuclusters-gpu.sock",
            dev_dir=self.dev_dir,
            poll_interval_s=0.02,
            watch_interval_s=0.02,
            backoff_s=(0.02, 0.1),
            register_timeout_s=2.0,
        )


@pytest.fixture
def node() -> Iterator[Node]:
    # Short paths: a unix socket's path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="dp-") as tmp:
        root = Path(tmp)
        plugin_dir, dev_dir = root / "dp", root / "dev"
        plugin_dir.mkdir()
        dev_dir.mkdir()
        for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]:
            (dev_dir / name).touch()
        yield Node(plugin_dir, dev_dir, SimulatedGpus("H100_SXM", dev_dir=dev_dir, node_id="n-1"))


@pytest.fixture
def kubelet(node: Node) -> Iterator[FakeKubelet]:
    k = FakeKubelet(node.kubelet_sock)
    yield k
    k.stop()


@pytest.fixture
def runner(node: Node) -> Iterator[DevicePluginRunner]:
    r = node.runner()
    yield r
    r.stop()


class Stream:
    """A ListAndWatch stream read by a thread, so each response can be
    awaited with a timeout."""

    def __init__(self, stub: pb_grpc.DevicePluginStub) -> None:
        self.call = stub.ListAndWatch(pb.Empty())
        self.responses: queue.Queue[pb.ListAndWatchResponse] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for r in self.call:
                self.responses.put(r)
        except grpc.RpcError:
            pass

    def next(self) -> dict[str, str]:
        r = self.responses.get(timeout=TIMEOUT_S)
        return {d.ID: d.health for d in r.devices}

    def cancel(self) -> None:
        self.call.cancel()


def plugin_stub(runner: DevicePluginRunner) -> tuple[grpc.Channel, pb_grpc.DevicePluginStub]:
    channel = grpc.insecure_channel(f"unix://{runner.socket_path}")
    return channel, pb_grpc.DevicePluginStub(channel)


# -- GPU identity ---------------------------------------------------------------


def test_simulated_gpu_uuids_are_stable_and_distinct(tmp_path: Path) -> None:
    a = [g.uuid for g in SimulatedGpus("H100_SXM", dev_dir=tmp_path, node_id="n-1").inventory()]
    again = [g.uuid for g in SimulatedGpus("B200_SXM", dev_dir=tmp_path, node_id="n-1").inventory()]
    other = [g.uuid for g in SimulatedGpus("H100_SXM", dev_dir=tmp_path, node_id="n-2").inventory()]
    assert len(a) == 8
    assert all(UUID_RE.match(u) for u in a)
    assert a == again  # stable: a function of the node and the index only
    assert len(set(a)) == 8  # distinct within a node
    assert not set(a) & set(other)  # and between nodes


def test_simulated_gpu_uuids_default_to_machine_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine_id = tmp_path / "machine-id"
    machine_id.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setattr(gpus_mod, "MACHINE_ID_FILE", machine_id)
    first = SimulatedGpus("H100_SXM", dev_dir=tmp_path).inventory()
    by_id = SimulatedGpus(
        "H100_SXM", dev_dir=tmp_path, node_id="0123456789abcdef0123456789abcdef"
    ).inventory()
    assert [g.uuid for g in first] == [g.uuid for g in by_id]


def test_gpu_info_to_dict_keeps_its_fields(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    d = SimulatedGpus("H100_SXM", dev_dir=tmp_path, count=1, node_id="n").inventory()[0].to_dict()
    assert d == {
        "index": 0,
        "name": "Simulated H100_SXM",
        "memory_gib": 80,
        "device": str(tmp_path / "nvidia0"),
        "present": True,
        "uuid": gpus_mod.simulated_gpu_uuid("n", 0),
    }


# -- the plugin against a fake kubelet --------------------------------------------


def test_registers_lists_and_allocates(
    node: Node, kubelet: FakeKubelet, runner: DevicePluginRunner
) -> None:
    runner.start()
    reg = kubelet.next_registration()
    assert reg.version == "v1beta1"
    assert reg.endpoint == "gpuclusters-gpu.sock"
    assert reg.resource_name == "nvidia.com/gpu"
    assert not reg.options.pre_start_required
    assert not reg.options.get_preferred_allocation_available
    wait_until(lambda: runner.registrations == 1, "registration 1")
    assert runner.socket_path == node.plugin_dir / reg.endpoint

    uuids = [g.uuid for g in node.gpus.inventory()]
    channel, stub = plugin_stub(runner)
    with channel:
        opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=TIMEOUT_S)
        assert not opts.pre_start_required and not opts.get_preferred_allocation_available

        stream = Stream(stub)
        assert stream.next() == dict.fromkeys(uuids, "Healthy")

        # kubelet may hand the IDs in any order: envs follow the GPUs' indices.
        resp = stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuids[5], uuids[2]])]
            ),
            timeout=TIMEOUT_S,
        )
        (c,) = resp.container_responses
        assert dict(c.envs) == {
            "NVIDIA_VISIBLE_DEVICES": f"{uuids[2]},{uuids[5]}",
            "CUDA_VISIBLE_DEVICES": "2,5",
        }
        assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
            ("/dev/nvidia2", str(node.dev_dir / "nvidia2"), "rw"),
            ("/dev/nvidia5", str(node.dev_dir / "nvidia5"), "rw"),
            ("/dev/nvidiactl", str(node.dev_dir / "nvidiactl"), "rw"),
        ]

        # The UVM device nodes go in only where the host has them.
        (node.dev_dir / "nvidia-uvm").touch()
        resp = stub.Allocate(
            pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=[uuids[0]]),
                    pb.ContainerAllocateRequest(devices_ids=[uuids[7]]),
                ]
            ),
            timeout=TIMEOUT_S,
        )
        assert [dict(c.envs)["CUDA_VISIBLE_DEVICES"] for c in resp.container_responses] == [
            "0",
            "7",
        ]
        assert [d.container_path for d in resp.container_responses[1].devices] == [
            "/dev/nvidia7",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
        ]

        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[
                        pb.ContainerAllocateRequest(devices_ids=[uuids[0], "GPU-nope"])
                    ]
                ),
                timeout=TIMEOUT_S,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope" in (err.value.details() or "")

        assert stub.GetPreferredAllocation(pb.PreferredAllocationRequest(), timeout=TIMEOUT_S) == (
            pb.PreferredAllocationResponse()
        )
        assert stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=[uuids[0]]), timeout=TIMEOUT_S
        ) == (pb.PreStartContainerResponse())

        # A GPU goes missing: a new list, with that GPU unhealthy.
        (node.dev_dir / "nvidia3").unlink()
        devices = stream.next()
        assert devices[uuids[3]] == "Unhealthy"
        assert sum(h == "Healthy" for h in devices.values()) == 7
        # ... and back.
        (node.dev_dir / "nvidia3").touch()
        assert stream.next() == dict.fromkeys(uuids, "Healthy")
        stream.cancel()


def test_reregisters_when_kubelet_restarts(node: Node, runner: DevicePluginRunner) -> None:
    first = FakeKubelet(node.kubelet_sock)
    second: FakeKubelet | None = None
    try:
        runner.start()
        first.next_registration()
        wait_until(lambda: runner.registrations == 1, "registration 1")
        # A kubelet restart: it dies, wipes every socket in the directory and
        # comes back with a fresh kubelet.sock.
        first.stop()
        runner.socket_path.unlink()
        node.kubelet_sock.unlink(missing_ok=True)
        second = FakeKubelet(node.kubelet_sock)
        reg = second.next_registration()
        assert reg.resource_name == "nvidia.com/gpu"
        assert reg.endpoint == "gpuclusters-gpu.sock"
        wait_until(lambda: runner.registrations == 2, "registration 2")
        channel, stub = plugin_stub(runner)
        with channel:
            stream = Stream(stub)
            assert len(stream.next()) == 8
            stream.cancel()
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_reregisters_when_kubelet_sock_is_replaced(node: Node, runner: DevicePluginRunner) -> None:
    first = FakeKubelet(node.kubelet_sock)
    second: FakeKubelet | None = None
    try:
        runner.start()
        first.next_registration()
        wait_until(lambda: runner.registrations == 1, "registration 1")
        first.stop()
        # Our socket survives this time; the new kubelet.sock alone says it.
        second = FakeKubelet(node.kubelet_sock)
        assert second.next_registration().resource_name == "nvidia.com/gpu"
        wait_until(lambda: runner.registrations == 2, "registration 2")
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_waits_for_kubelet_and_retries_failed_registration(
    node: Node, runner: DevicePluginRunner
) -> None:
    runner.start()
    time.sleep(0.1)  # several watch intervals: nothing to do without kubelet
    assert not runner.socket_path.exists()
    assert runner.registrations == 0
    kubelet = FakeKubelet(node.kubelet_sock, fail_first=2)
    try:
        assert kubelet.next_registration().resource_name == "nvidia.com/gpu"
        assert kubelet.calls == 3
        wait_until(lambda: runner.registrations == 1, "registration 1")
    finally:
        kubelet.stop()


def test_stale_socket_is_replaced_and_stop_cleans_up(
    node: Node, kubelet: FakeKubelet, runner: DevicePluginRunner
) -> None:
    runner.socket_path.write_text("stale")
    runner.start()
    kubelet.next_registration()
    assert runner.socket_path.is_socket()
    runner.stop()
    assert not runner.socket_path.exists()
    assert node.kubelet_sock.exists()  # kubelet's, not ours to remove


def test_stop_without_kubelet_is_prompt(runner: DevicePluginRunner) -> None:
    runner.start()
    t0 = time.monotonic()
    runner.stop()
    assert time.monotonic() - t0 < 2.0


# -- the agent's wiring -----------------------------------------------------------


def test_agent_starts_the_plugin_only_when_wanted(
    node: Node, kubelet: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCLUSTERS_AGENT_DEVICE_PLUGIN_DIR", str(node.plugin_dir))

    monkeypatch.setenv("GPUCLUSTERS_AGENT_DEVICE_PLUGIN", "0")
    assert agent_main.start_device_plugin(node.gpus) is None

    monkeypatch.delenv("GPUCLUSTERS_AGENT_DEVICE_PLUGIN")
    no_gpus = SimulatedGpus("H100_SXM", dev_dir=node.plugin_dir / "nothing", node_id="n-1")
    assert agent_main.start_device_plugin(no_gpus) is None

    runner = agent_main.start_device_plugin(node.gpus)
    assert runner is not None
    try:
        assert runner.plugin_dir == node.plugin_dir
        assert kubelet.next_registration().endpoint == runner.socket_name
        wait_until(runner.socket_path.exists, "the plugin socket")
    finally:
        runner.stop()
    assert not runner.socket_path.exists()


# -- real GPUs: node.json's devices -------------------------------------------------


class RealGpus:
    """A GpuBackend of GPUs whose device nodes are named after minors that
    differ from their indices (as NVML's may)."""

    name = "nvml"

    def __init__(self, dev_dir: Path, minors: list[int]) -> None:
        self._gpus = [
            GpuInfo(
                index=i,
                name="NVIDIA H100 80GB HBM3",
                memory_gib=80,
                device=str(dev_dir / f"nvidia{minor}"),
                present=True,
                uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            )
            for i, minor in enumerate(minors)
        ]
        self.count = len(self._gpus)

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def health(self) -> list[Any]:
        return []


@dataclass
class GpuNode:
    dev_dir: Path
    lib_dir: Path
    bin_dir: Path
    gpus: RealGpus
    info: dict[str, Any]  # node.json's devices


@pytest.fixture
def gpu_node(tmp_path: Path) -> GpuNode:
    """A node's view of four real GPUs (minors 1, 0, 2, 3 for indices 0..3),
    their control nodes and the driver's files, as node.json describes them."""
    dev, lib, bin_ = tmp_path / "dev", tmp_path / "lib", tmp_path / "bin"
    for d in (dev / "nvidia-caps", dev / "infiniband", lib, bin_):
        d.mkdir(parents=True)
    names = [f"nvidia{i}" for i in range(4)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    names += ["nvidia-caps/nvidia-cap1", "infiniband/uverbs0"]
    for name in names:
        (dev / name).touch()
    real = lib / "libcuda.so.550.54.15"
    real.touch()
    (lib / "libcuda.so.1").symlink_to(real.name)  # ldconfig's soname link
    (lib / "libcuda.so").symlink_to("libcuda.so.1")  # and the development one
    (lib / "libnvidia-ml.so.550.54.15").touch()
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    (lib / "libother.so.1").symlink_to("libother.so.1.0")  # not the driver's
    (lib / "libother.so.1.0").touch()
    (bin_ / "nvidia-smi").touch()
    # node.json's devices: what the netns provider writes (node-side paths);
    # nvidia-modeset and one library are listed but gone from the node.
    info = {
        "device_nodes": [f"/dev/{n}" for n in names[:4]]
        + ["/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        + ["/dev/nvidia-caps/nvidia-cap1", "/dev/infiniband/uverbs0", "/dev/nvidiactl"],
        "mounts": [
            [f"/host{real}", str(real)],
            [f"/host{lib}/libnvidia-ml.so.550.54.15", f"{lib}/libnvidia-ml.so.550.54.15"],
            [f"/host{lib}/libgone.so.550.54.15", f"{lib}/libgone.so.550.54.15"],
            [f"/host{bin_}/nvidia-smi", f"{bin_}/nvidia-smi"],
        ],
        "library_dirs": [str(lib)],
    }
    return GpuNode(dev, lib, bin_, RealGpus(dev, [1, 0, 2, 3]), info)


class NoAbort:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"Allocate aborted: {code} {details}")


def allocate(plugin: GpuDevicePlugin, *requests: list[str]) -> list[pb.ContainerAllocateResponse]:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in requests]
    )
    context: Any = NoAbort()
    return list(plugin.Allocate(request, context).container_responses)


def test_node_devices_from_node_info() -> None:
    devices = NodeDevices.from_node_info(
        {
            "device_nodes": ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia0"],
            "mounts": [["/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"]],
        }
    )
    assert devices == NodeDevices(
        device_nodes=("/dev/nvidia0", "/dev/nvidiactl"),
        mounts=(("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),),
    )
    # A node on the node image: its files below the driver root, each with
    # the path containers get it at.
    relocated = NodeDevices.from_node_info(
        {
            "mounts": [
                ["/usr/bin/nvidia-smi", "/run/nvidia/driver/bin/nvidia-smi", "/usr/bin/nvidia-smi"]
            ],
            "driver_root": "/run/nvidia/driver/",
        }
    )
    assert relocated.mounts == (("/run/nvidia/driver/bin/nvidia-smi", "/usr/bin/nvidia-smi"),)
    assert relocated.driver_root == "/run/nvidia/driver"
    assert relocated.container_path("/run/nvidia/driver/bin/nvidia-smi") == "/usr/bin/nvidia-smi"
    assert (
        relocated.container_path("/run/nvidia/driver/usr/lib/libcuda.so.1")
        == "/usr/lib/libcuda.so.1"
    )
    assert relocated.container_path("/run/x.sock") == "/run/x.sock"
    bad: Any
    for bad in (
        [],
        {"device_nodes": "/dev/nvidia0"},
        {"device_nodes": ["/tmp/nvidia0"]},
        {"device_nodes": ["/dev/../etc/shadow"]},
        {"mounts": [["/usr/bin/nvidia-smi"]]},
        {"mounts": [["/x", "relative"]]},
        {"mounts": [["/x", "/y", "relative"]]},
        {"mounts": [["/x", "/y", "/z", "/w"]]},
        {"driver_root": "run/nvidia"},
        {"library_dirs": ["lib"]},
    ):
        with pytest.raises(ValueError):
            NodeDevices.from_node_info(bad)


def test_allocate_with_real_devices(gpu_node: GpuNode) -> None:
    devices = NodeDevices.from_node_info(gpu_node.info)
    plugin = GpuDevicePlugin(gpu_node.gpus, dev_dir=gpu_node.dev_dir, devices=devices)
    uuids = [g.uuid for g in gpu_node.gpus.inventory()]
    dev, lib = gpu_node.dev_dir, gpu_node.lib_dir

    one, two, empty = allocate(plugin, [uuids[3], uuids[0]], [uuids[2]], [])
    # The allocated GPUs' own nodes (named after their minors), then every
    # control node the node has, once; no other GPU's, no InfiniBand's.
    assert [(d.container_path, d.host_path, d.permissions) for d in one.devices] == [
        ("/dev/nvidia1", str(dev / "nvidia1"), "rw"),
        ("/dev/nvidia3", str(dev / "nvidia3"), "rw"),
        ("/dev/nvidiactl", str(dev / "nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), "rw"),
        ("/dev/nvidia-uvm-tools", str(dev / "nvidia-uvm-tools"), "rw"),
        ("/dev/nvidia-caps/nvidia-cap1", str(dev / "nvidia-caps/nvidia-cap1"), "rw"),
    ]
    assert [d.container_path for d in two.devices][:2] == ["/dev/nvidia2", "/dev/nvidiactl"]
    assert "/dev/nvidia1" not in [d.container_path for d in two.devices]
    # The driver's files at the node's paths, read-only, with the soname
    # links ldconfig made next to them; what the node lacks is left out.
    expected_mounts = [
        str(lib / "libcuda.so.550.54.15"),
        str(lib / "libnvidia-ml.so.550.54.15"),
        str(gpu_node.bin_dir / "nvidia-smi"),
        str(lib / "libcuda.so"),
        str(lib / "libcuda.so.1"),
        str(lib / "libnvidia-ml.so.1"),
    ]
    for c in (one, two):
        assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [
            (p, p, True) for p in expected_mounts
        ]
    # CUDA_VISIBLE_DEVICES counts the container's GPUs, not the node's
    # indices; the library directory is not a default one of the loader's.
    assert dict(one.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{uuids[0]},{uuids[3]}",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "LD_LIBRARY_PATH": str(lib),
    }
    assert dict(two.envs)["CUDA_VISIBLE_DEVICES"] == "0"
    assert empty == pb.ContainerAllocateResponse()


def test_relocated_driver_files_go_to_containers_at_the_hosts_paths(tmp_path: Path) -> None:
    """A node on the node image sees the driver below its driver root
    (linux/devices.py DeviceSet.relocated); containers get each file, and the
    soname links the node's ldconfig made beside them, at the host's path."""
    root = tmp_path / "run/nvidia/driver"
    lib, bin_ = root / "usr/lib/x86_64-linux-gnu", root / "bin"
    dev = tmp_path / "dev"
    for d in (lib, bin_, dev):
        d.mkdir(parents=True)
    for name in ("nvidia0", "nvidiactl"):
        (dev / name).touch()
    (lib / "libcuda.so.550.54.15").touch()
    (lib / "libcuda.so.1").symlink_to("libcuda.so.550.54.15")
    (bin_ / "nvidia-smi").touch()
    info = {
        "device_nodes": ["/dev/nvidia0", "/dev/nvidiactl"],
        "mounts": [
            ["/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", f"{lib}/libcuda.so.550.54.15",
             "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"],
            ["/usr/sbin/nvidia-smi", f"{bin_}/nvidia-smi", "/usr/sbin/nvidia-smi"],
        ],
        "library_dirs": ["/usr/lib/x86_64-linux-gnu"],
        "driver_root": str(root),
    }  # fmt: skip
    gpus = RealGpus(dev, [0])
    plugin = GpuDevicePlugin(gpus, dev_dir=dev, devices=NodeDevices.from_node_info(info))
    (c,) = allocate(plugin, [gpus.inventory()[0].uuid])
    assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", f"{lib}/libcuda.so.550.54.15", True),
        ("/usr/sbin/nvidia-smi", f"{bin_}/nvidia-smi", True),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", f"{lib}/libcuda.so.1", True),
    ]
    # The containers' library folder is a loader default: no LD_LIBRARY_PATH.
    assert "LD_LIBRARY_PATH" not in c.envs


def test_real_devices_in_default_loader_dirs_leave_ld_library_path_alone(
    gpu_node: GpuNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin_mod, "DEFAULT_LOADER_DIRS", frozenset({str(gpu_node.lib_dir)}))
    info = {**gpu_node.info, "library_dirs": []}  # none listed: the libraries' own
    plugin = GpuDevicePlugin(
        gpu_node.gpus, dev_dir=gpu_node.dev_dir, devices=NodeDevices.from_node_info(info)
    )
    (c,) = allocate(plugin, [gpu_node.gpus.inventory()[0].uuid])
    assert "LD_LIBRARY_PATH" not in c.envs
    monkeypatch.setattr(plugin_mod, "DEFAULT_LOADER_DIRS", frozenset())
    (c,) = allocate(plugin, [gpu_node.gpus.inventory()[0].uuid])
    assert c.envs["LD_LIBRARY_PATH"] == str(gpu_node.lib_dir)


def test_simulated_allocate_is_unchanged_without_devices(node: Node) -> None:
    plugin = GpuDevicePlugin(node.gpus, dev_dir=node.dev_dir)
    uuids = [g.uuid for g in node.gpus.inventory()]
    (c,) = allocate(plugin, [uuids[5], uuids[2]])
    assert dict(c.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{uuids[2]},{uuids[5]}",
        "CUDA_VISIBLE_DEVICES": "2,5",
    }
    assert [d.container_path for d in c.devices] == [
        "/dev/nvidia2",
        "/dev/nvidia5",
        "/dev/nvidiactl",
    ]
    assert not c.mounts


def test_agent_hands_node_json_devices_to_the_plugin(
    node: Node, gpu_node: GpuNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCLUSTERS_AGENT_DEVICE_PLUGIN_DIR", str(node.plugin_dir))
    runner = agent_main.start_device_plugin(node.gpus, gpu_node.info)
    assert runner is not None
    runner.stop()
    assert runner.devices == NodeDevices.from_node_info(gpu_node.info)
    # Unreadable devices: the plugin still runs, as for simulated GPUs.
    runner = agent_main.start_device_plugin(node.gpus, {"mounts": "nope"})
    assert runner is not None
    runner.stop()
    assert runner.devices is None


def test_provider_writes_devices_into_gpu_nodes_node_json(tmp_path: Path) -> None:
    host_dev = tmp_path / "driver" / "dev"
    devices = DeviceSet(
        device_nodes=(f"{host_dev}/nvidia0", f"{host_dev}/nvidiactl"),
        mounts=(("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),),
        gpu_count=1,
        dev_root=str(host_dev),
        library_dirs=("/usr/lib/x86_64-linux-gnu",),
    )
    host = HostSpec(name="h1", gpu_type="H100_SXM", region="", ib_island="ib-1", num_gpus=1)
    provider = NetnsNodeProvider(
        NetnsProviderConfig(fleet=[host], home=tmp_path / "home", shares=(), devices=devices)
    )
    net = ClusterNetwork(cluster_id="c1", index=1, bridge="gcb-c1")

    def record(kind: Any) -> NodeRecord:
        return NodeRecord(
            node_id="0123456789ab",
            kind=kind,
            name="n1",
            hostname="n1",
            cluster_id="c1",
            cluster_name="c",
            address="10.0.0.2",
            ns_dir=str(tmp_path / "ns"),
            nodes_dir=str(tmp_path / "nodes"),
            host="h1",
        )

    info = provider._boot_spec(record("gpu"), net, None, ()).node_info
    assert json.loads(json.dumps(info))["devices"] == {
        "device_nodes": ["/dev/nvidia0", "/dev/nvidiactl"],
        "mounts": [
            ["/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"]
        ],
        "library_dirs": ["/usr/lib/x86_64-linux-gnu"],
        "driver_root": None,
    }
    assert NodeDevices.from_node_info(info["devices"]).control_nodes() == ["/dev/nvidiactl"]
    assert "devices" not in provider._boot_spec(record("service"), net, None, ()).node_info

    # Nodes on a node image: the driver's files below the node's driver root
    # (the image's /usr is read-only and has none), containers' paths kept.
    image = tmp_path / "image"
    for need in nodeimage.NEEDS:
        (image / need).parent.mkdir(parents=True, exist_ok=True)
        (image / need).touch()
    on_image = NetnsNodeProvider(
        NetnsProviderConfig(
            fleet=[host], home=tmp_path / "home", shares=(), devices=devices, image=image
        )
    )
    info = on_image._boot_spec(record("gpu"), net, None, ()).node_info
    host_smi = "/run/nvidia/driver/usr/bin/nvidia-smi"  # a containerised driver's
    assert info["devices"]["mounts"] == [
        [host_smi, "/run/nvidia/driver/bin/nvidia-smi", "/usr/bin/nvidia-smi"]
    ]
    assert info["devices"]["driver_root"] == "/run/nvidia/driver"
    boot = on_image._boot_spec(record("gpu"), net, None, ())
    assert boot.devices is not None
    assert boot.devices.to_nsinit()["library_dirs"] == [
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"
    ]
