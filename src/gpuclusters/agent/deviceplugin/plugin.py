"""The ``nvidia.com/gpu`` device plugin: kubelet's device-plugin API v1beta1.

Two parts:

``GpuDevicePlugin`` is the gRPC ``DevicePlugin`` service. Its devices are the
node's GPUs from a ``GpuBackend`` (NVML on real GPUs, simulated elsewhere), identified
by their UUIDs; a GPU whose device node is present is ``Healthy``, any other
is ``Unhealthy``. ``ListAndWatch`` sends the list at once and again whenever
a poll of the backend (every ``poll_interval_s``) finds it changed.
``Allocate`` turns device IDs into what the container needs, one of two ways.
Unknown IDs fail the call with ``INVALID_ARGUMENT``. No pre-start hook, no
preferred allocation.

* Simulated GPUs (no ``devices`` in node.json): ``NVIDIA_VISIBLE_DEVICES``
  (the UUIDs) and ``CUDA_VISIBLE_DEVICES`` (the node-local indices, ascending:
  the convention our Slurm GRES uses too), both in index order, and the
  device nodes (``/dev/nvidia<minor>``, ``/dev/nvidiactl`` and the UVM nodes
  where the node has them).
* Real GPUs (:class:`NodeDevices`, node.json's ``devices``: what the host
  bound into the node, see ``linux/devices.py``). The node's containerd
  (1.6) has no CDI and no NVIDIA runtime runs its containers, so the plugin
  does the toolkit's job: the allocated GPUs' device nodes, every NVIDIA
  control node (nvidiactl, UVM, modeset, ``/dev/nvidia-caps*/...``; never
  another GPU's ``/dev/nvidia<N>``), the driver's files (libraries, tools
  such as nvidia-smi, firmware, sockets) bound read-only at the paths the
  driver has them at on the host (a node on the node image sees them below
  its driver root instead), together with the soname links ``ldconfig`` made next
  to the libraries (no ldconfig runs in the container), and the envs; see
  :meth:`GpuDevicePlugin._real_response` for ``CUDA_VISIBLE_DEVICES`` and
  ``LD_LIBRARY_PATH``.

``DevicePluginRunner`` keeps the service registered with kubelet, in one
supervisor thread: wait for ``<plugin_dir>/kubelet.sock``; serve the plugin on
``<plugin_dir>/<socket_name>`` (a stale socket is removed first); call
``Registration.Register`` on kubelet.sock; then watch. kubelet, when it
restarts, deletes every socket in the directory and makes a new kubelet.sock,
and forgets its plugins, so when our socket goes away or kubelet.sock is
replaced (its inode changes) the runner stops its server and starts over.
Any failure is logged and retried after a backoff (doubling up to a cap, reset
by a successful registration): the agent never dies for the plugin's sake,
and on a node without kubelet the runner just waits for kubelet.sock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gpuclusters.agent.deviceplugin import api_pb2 as pb
from gpuclusters.agent.deviceplugin import api_pb2_grpc as pb_grpc
from gpuclusters.agent.gpus import GpuBackend, GpuInfo

log = logging.getLogger("gpuclusters.agent.deviceplugin")

API_VERSION = "v1beta1"
RESOURCE_NAME = "nvidia.com/gpu"
DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_SOCKET_NAME = "gpuclusters-gpu.sock"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# Device nodes every GPU container gets besides its GPUs' own; the UVM ones
# only where the host has them (the driver makes them on first CUDA use).
CONTROL_DEVICE = "nvidiactl"
OPTIONAL_DEVICES = ("nvidia-uvm", "nvidia-uvm-tools")

DeviceState = tuple[tuple[str, str], ...]  # ((uuid, health), ...) in index order

_GPU_NODE = re.compile(r"^nvidia\d+$")
_T = TypeVar("_T")
_SHARED_OBJECT = re.compile(r"\.so(\.[0-9.]+)?$")
# Directories the dynamic loader searches without being told (glibc's system
# directories: the multiarch ones on Debian and Ubuntu, lib64 on Red Hat's
# family, plain lib everywhere). Driver libraries the node sees elsewhere put
# their directory in the container's LD_LIBRARY_PATH. An image of the other
# family than the host's (a UBI image on a Debian host) does not search the
# host's directory; such a pod sets LD_LIBRARY_PATH itself.
DEFAULT_LOADER_DIRS = frozenset(
    {
        "/lib",
        "/usr/lib",
        "/lib64",
        "/usr/lib64",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
    }
)


def _unique(items: Iterable[_T]) -> list[_T]:
    return list(dict.fromkeys(items))


def _node_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or ".." in value.split("/"):
        raise ValueError(f"{what} {value!r} is not an absolute path without '..'")
    return value


@dataclass(frozen=True, slots=True)
class NodeDevices:
    """The host's real GPU devices as this node sees them: node.json's
    ``devices``, written by the netns provider from the host's ``DeviceSet``.
    ``device_nodes`` are below /dev; ``mounts`` pair the path the node sees
    a driver file at with the path containers get it at (the same, but on a
    node whose driver files were relocated below ``driver_root``);
    ``library_dirs`` the folders the driver's libraries are in, as
    containers see them (the CDI spec's ``update-ldcache`` folders; empty:
    the mounted libraries' own)."""

    device_nodes: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()
    library_dirs: tuple[str, ...] = ()
    driver_root: str | None = None

    @classmethod
    def from_node_info(cls, data: Any) -> NodeDevices:
        """From node.json's ``devices``: ``{"device_nodes": [path, ...],
        "mounts": [[host path, node path, container path], ...] (the
        container path may be left out: the node path), "library_dirs":
        [dir, ...], "driver_root": dir or null}``. Raises ValueError when it
        is not that."""
        if not isinstance(data, Mapping):
            raise ValueError(f"devices is not a mapping: {type(data).__name__}")
        nodes, mounts, dirs = (
            data.get("device_nodes") or [],
            data.get("mounts") or [],
            data.get("library_dirs") or [],
        )
        if not all(isinstance(x, list) for x in (nodes, mounts, dirs)):
            raise ValueError("devices: device_nodes, mounts and library_dirs must be lists")
        for path in nodes:
            if not _node_path(path, "device node").startswith("/dev/"):
                raise ValueError(f"device node {path!r} is not below /dev")
        pairs = []
        for entry in mounts:
            if not isinstance(entry, list) or len(entry) not in (2, 3):
                raise ValueError(
                    f"mount {entry!r} is not a [host path, node path, container path] list"
                )
            node = _node_path(entry[1], "mount path")
            pairs.append((node, _node_path(entry[-1], "container path")))
        root = data.get("driver_root")
        return cls(
            device_nodes=tuple(_unique(nodes)),
            mounts=tuple(_unique(pairs)),
            library_dirs=tuple(_unique(_node_path(d, "library dir") for d in dirs)),
            driver_root=None if root is None else _node_path(root, "driver root").rstrip("/"),
        )

    def container_path(self, node_path: str) -> str:
        """Where containers get a file the node has at ``node_path``: its
        mount's container path, else (a soname link ldconfig made in the
        node) the path below the driver root, else the same path."""
        for node, container in self.mounts:
            if node == node_path:
                return container
        root = self.driver_root
        if root is not None and node_path.startswith(root + "/"):
            return node_path[len(root) :]
        return node_path

    def control_nodes(self) -> list[str]:
        """The NVIDIA device nodes every GPU container gets: all below
        /dev/nvidia* but the GPUs' own (/dev/nvidia<N>); not InfiniBand's."""
        out = []
        for path in self.device_nodes:
            top = path[len("/dev/") :].split("/")[0]
            if top.startswith("nvidia") and not _GPU_NODE.match(top):
                out.append(path)
        return out


@dataclass(frozen=True, slots=True)
class _DriverEdits:
    """What every real-GPU container gets besides its GPUs' device nodes."""

    devices: tuple[tuple[str, str], ...]  # (container path, node path)
    mounts: tuple[tuple[str, str], ...]  # (container path, node path)
    ld_library_path: str


def _soname_links(files: list[str]) -> list[str]:
    """Symbolic links next to the driver's libraries that lead to one of
    them: the soname links ``ldconfig`` made on the host (libcuda.so.1 ->
    libcuda.so.550.54.15), which a CDI spec leaves to a hook we do not run
    and the container's loader needs (it looks for the soname)."""
    libs = [f for f in files if _SHARED_OBJECT.search(os.path.basename(f))]
    targets = {os.path.realpath(f) for f in libs}
    links = []
    for d in _unique(os.path.dirname(f) for f in libs):
        try:
            with os.scandir(d) as entries:
                for e in entries:
                    if ".so" in e.name and e.is_symlink() and os.path.realpath(e.path) in targets:
                        links.append(e.path)
        except OSError:
            continue
    return sorted(links)


class GpuDevicePlugin(pb_grpc.DevicePluginServicer):
    """The ``DevicePlugin`` gRPC service over a ``GpuBackend``. ``close()``
    ends every open ``ListAndWatch`` stream."""

    def __init__(
        self,
        backend: GpuBackend,
        *,
        dev_dir: Path = Path("/dev"),
        poll_interval_s: float = 5.0,
        devices: NodeDevices | None = None,
    ) -> None:
        self._backend = backend
        self._dev_dir = dev_dir
        self._devices = devices
        self._poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._closed = False
        self._wakers: set[threading.Event] = set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for wake in self._wakers:
                wake.set()

    def device_state(self) -> DeviceState:
        gpus = sorted(self._backend.inventory(), key=lambda g: g.index)
        return tuple((g.uuid, HEALTHY if g.present else UNHEALTHY) for g in gpus)

    # -- the DevicePlugin service ---------------------------------------------

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=False
        )

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        wake = threading.Event()
        context.add_callback(wake.set)  # the stream ended: kubelet went away
        with self._lock:
            if self._closed:
                return
            self._wakers.add(wake)
        try:
            sent: DeviceState | None = None
            while not wake.is_set():
                state: DeviceState | None
                try:
                    state = self.device_state()
                except Exception:
                    log.exception("GPU inventory failed; keeping the last device list")
                    state = sent
                if state is not None and state != sent:
                    log.info(
                        "ListAndWatch: %d GPUs, %d healthy",
                        len(state),
                        sum(h == HEALTHY for _, h in state),
                    )
                    yield pb.ListAndWatchResponse(
                        devices=[pb.Device(ID=uuid, health=health) for uuid, health in state]
                    )
                    sent = state
                wake.wait(self._poll_interval_s)
        finally:
            with self._lock:
                self._wakers.discard(wake)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse()

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        by_uuid = {g.uuid: g for g in self._backend.inventory()}
        edits = self._driver_edits() if self._devices is not None else None
        response = pb.AllocateResponse()
        for creq in request.container_requests:
            unknown = [d for d in creq.devices_ids if d not in by_uuid]
            if unknown:
                log.warning("Allocate: unknown device ids %s", unknown)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"unknown device ids: {', '.join(unknown)}"
                )
            gpus = sorted({by_uuid[d] for d in creq.devices_ids}, key=lambda g: g.index)
            if edits is None:
                response.container_responses.append(self._container_response(gpus))
            else:
                response.container_responses.append(self._real_response(gpus, edits))
        return response

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    # -- helpers --------------------------------------------------------------

    @staticmethod
    def _gpu_devices(out: pb.ContainerAllocateResponse, gpus: list[GpuInfo]) -> None:
        for g in gpus:
            # The node's name for it (/dev/nvidia<minor>), not one made from
            # NVML's index: NVML and CUDA in the container open the device
            # node named after the minor number, which need not be the index.
            out.devices.append(
                pb.DeviceSpec(
                    container_path="/dev/" + os.path.basename(g.device),
                    host_path=g.device,
                    permissions="rw",
                )
            )

    def _driver_edits(self) -> _DriverEdits:
        """The control nodes and driver files of node.json's ``devices`` that
        the node has now (a bind mount or device of a missing file would fail
        the container's creation), once per Allocate call."""
        assert self._devices is not None
        devices = []
        for path in self._devices.control_nodes():
            node = self._dev_dir / path[len("/dev/") :]
            if node.exists():
                devices.append((path, str(node)))
        files = [node for node, _ in self._devices.mounts if os.path.exists(node)]
        files = _unique([*files, *_soname_links(files)])
        mounts = [(self._devices.container_path(f), f) for f in files]
        mounted_dirs = {os.path.dirname(c) for c, _ in mounts}
        lib_dirs = self._devices.library_dirs or _unique(
            os.path.dirname(c) for c, _ in mounts if _SHARED_OBJECT.search(os.path.basename(c))
        )
        extra_dirs = [
            d.rstrip("/")
            for d in lib_dirs
            if d.rstrip("/") in mounted_dirs and d.rstrip("/") not in DEFAULT_LOADER_DIRS
        ]
        return _DriverEdits(tuple(devices), tuple(mounts), ":".join(_unique(extra_dirs)))

    def _real_response(
        self, gpus: list[GpuInfo], edits: _DriverEdits
    ) -> pb.ContainerAllocateResponse:
        out = pb.ContainerAllocateResponse()
        if not gpus:
            return out
        out.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in gpus)
        # Not the node's indices: CUDA (and NVML) enumerate only the GPUs
        # whose /dev/nvidia<minor> the process can open, and the container
        # has its allocated ones only, so they are CUDA devices 0..k-1 there.
        # The node's indices would name devices that do not exist (GPUs 2
        # and 5: "2,5" against two devices), and CUDA stops at the first
        # invalid entry: the container would see no GPU at all. 0..k-1 is
        # what an unset variable means; setting it overrides an image's own.
        out.envs["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
        if edits.ld_library_path:
            # Replaces the image's LD_LIBRARY_PATH (a device plugin cannot
            # append to it): only when a driver library is outside the
            # loader's default directories.
            out.envs["LD_LIBRARY_PATH"] = edits.ld_library_path
        self._gpu_devices(out, gpus)
        for container_path, node_path in edits.devices:
            out.devices.append(
                pb.DeviceSpec(container_path=container_path, host_path=node_path, permissions="rw")
            )
        for container_path, node_path in edits.mounts:
            out.mounts.append(
                pb.Mount(container_path=container_path, host_path=node_path, read_only=True)
            )
        return out

    def _container_response(self, gpus: list[GpuInfo]) -> pb.ContainerAllocateResponse:
        out = pb.ContainerAllocateResponse()
        if not gpus:
            return out
        out.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in gpus)
        out.envs["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
        self._gpu_devices(out, gpus)
        extra = [CONTROL_DEVICE] + [d for d in OPTIONAL_DEVICES if (self._dev_dir / d).exists()]
        for name in extra:
            out.devices.append(
                pb.DeviceSpec(
                    container_path=f"/dev/{name}",
                    host_path=str(self._dev_dir / name),
                    permissions="rw",
                )
            )
        return out


FileIdentity = tuple[int, int, int]


def _identity(path: Path) -> FileIdentity | None:
    """What tells one file at ``path`` from the next one there: (device,
    inode, ctime). The inode alone will not do: a file system reuses a freed
    inode number at once, so a socket removed and made again often has the
    same one. None when nothing is there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return f"kubelet: {exc.code().name} {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class DevicePluginRunner:
    """Serves ``GpuDevicePlugin`` on ``<plugin_dir>/<socket_name>`` and keeps
    it registered with the kubelet at ``<plugin_dir>/kubelet.sock``, from a
    background thread, across kubelet restarts (see the module docstring).

    ``start()`` returns at once; ``stop()`` stops the server, removes the
    plugin socket and joins the thread. The intervals are parameters so tests
    can run in milliseconds; the defaults suit a real node."""

    def __init__(
        self,
        backend: GpuBackend,
        *,
        plugin_dir: Path = DEFAULT_PLUGIN_DIR,
        socket_name: str = DEFAULT_SOCKET_NAME,
        resource_name: str = RESOURCE_NAME,
        dev_dir: Path = Path("/dev"),
        devices: NodeDevices | None = None,
        poll_interval_s: float = 5.0,
        watch_interval_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.5, 10.0),
        register_timeout_s: float = 5.0,
    ) -> None:
        if "/" in socket_name:
            raise ValueError(f"socket_name must be a file name, not {socket_name!r}")
        self.backend = backend
        self.plugin_dir = plugin_dir.absolute()
        self.socket_name = socket_name
        self.resource_name = resource_name
        self.dev_dir = dev_dir
        self.devices = devices
        self.poll_interval_s = poll_interval_s
        self.watch_interval_s = watch_interval_s
        self.backoff_s = backoff_s
        self.register_timeout_s = register_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self._plugin: GpuDevicePlugin | None = None
        self._socket_identity: FileIdentity | None = None
        self._registrations = 0

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def registrations(self) -> int:
        """How many times kubelet has accepted our registration."""
        return self._registrations

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("device plugin runner already started")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._supervise, name="gpuclusters-deviceplugin", daemon=True
        )
        self._thread.start()
        log.info(
            "device plugin for %s: socket %s, kubelet at %s",
            self.resource_name,
            self.socket_path,
            self.kubelet_socket,
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("device plugin thread did not stop within %.1fs", timeout_s)

    # -- the supervisor thread ------------------------------------------------

    def _supervise(self) -> None:
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            error: Exception | None = None
            try:
                if not self._wait_for_kubelet():
                    break
                kubelet = _identity(self.kubelet_socket)
                self._serve()
                self._register()
                delay = self.backoff_s[0]
                self._watch(kubelet)
            except Exception as exc:
                error = exc
            finally:
                self._shutdown()
            if error is not None and not self._stop.is_set():
                log.warning("device plugin: %s; retrying in %.2fs", _describe(error), delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_s[1])
        log.info("device plugin stopped")

    def _wait_for_kubelet(self) -> bool:
        """Block until kubelet.sock exists (True) or stop() is called (False)."""
        waiting = False
        while not self._stop.is_set():
            if self.kubelet_socket.exists():
                return True
            if not waiting:
                log.info("device plugin: waiting for %s", self.kubelet_socket)
                waiting = True
            self._stop.wait(self.watch_interval_s)
        return False

    def _serve(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # stale, from an earlier run
        plugin = GpuDevicePlugin(
            self.backend,
            dev_dir=self.dev_dir,
            poll_interval_s=self.poll_interval_s,
            devices=self.devices,
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
        self._plugin, self._server = plugin, server
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._socket_identity = _identity(self.socket_path)
        if self._socket_identity is None:
            raise RuntimeError(f"gRPC server started but {self.socket_path} does not exist")

    def _register(self) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_name,
            resource_name=self.resource_name,
            options=pb.DevicePluginOptions(
                pre_start_required=False, get_preferred_allocation_available=False
            ),
        )
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout_s)
        self._registrations += 1
        log.info("device plugin registered with kubelet as %s", self.resource_name)

    def _watch(self, kubelet: FileIdentity | None) -> None:
        """Return when kubelet has restarted (or stop() was called)."""
        while not self._stop.wait(self.watch_interval_s):
            if _identity(self.socket_path) != self._socket_identity:
                log.info("device plugin: %s went away (kubelet restart?)", self.socket_path)
                return
            if _identity(self.kubelet_socket) != kubelet:
                log.info("device plugin: %s was replaced (kubelet restart)", self.kubelet_socket)
                return

    def _shutdown(self) -> None:
        """Stop serving and remove our socket (unless kubelet already did, or
        something else now has its name). Never raises."""
        plugin, server, ours = self._plugin, self._server, self._socket_identity
        self._plugin = self._server = self._socket_identity = None
        try:
            if plugin is not None:
                plugin.close()
            if server is not None:
                server.stop(grace=1.0).wait(5.0)
            if ours is not None and _identity(self.socket_path) == ours:
                self.socket_path.unlink(missing_ok=True)
        except Exception:
            log.exception("device plugin: error while shutting down the server")
