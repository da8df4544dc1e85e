"""The ``nvidia.com/gpu`` device plugin: kubelet's device-plugin API v1beta1.

Two parts:

``GpuDevicePlugin`` is the gRPC ``DevicePlugin`` service. Its devices are the
node's GPUs from a ``GpuBackend`` (NVML on real GPUs, simulated elsewhere), identified
by their UUIDs; a GPU whose device node is present is ``Healthy``, any other
is ``Unhealthy``. ``ListAndWatch`` sends the list at once and again whenever
a poll of the backend (every ``poll_interval_s``) finds it changed.
``Allocate`` turns device IDs into what the container needs:
``NVIDIA_VISIBLE_DEVICES`` (the UUIDs) and ``CUDA_VISIBLE_DEVICES`` (the
node-local indices, ascending: the convention our Slurm GRES uses too), both
in index order, and the device nodes (``/dev/nvidia<minor>``, ``/dev/nvidiactl``
and the UVM nodes where the host has them). Unknown IDs fail the call with
``INVALID_ARGUMENT``. No pre-start hook, no preferred allocation.

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
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

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


class GpuDevicePlugin(pb_grpc.DevicePluginServicer):
    """The ``DevicePlugin`` gRPC service over a ``GpuBackend``. ``close()``
    ends every open ``ListAndWatch`` stream."""

    def __init__(
        self, backend: GpuBackend, *, dev_dir: Path = Path("/dev"), poll_interval_s: float = 5.0
    ) -> None:
        self._backend = backend
        self._dev_dir = dev_dir
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
        response = pb.AllocateResponse()
        for creq in request.container_requests:
            unknown = [d for d in creq.devices_ids if d not in by_uuid]
            if unknown:
                log.warning("Allocate: unknown device ids %s", unknown)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"unknown device ids: {', '.join(unknown)}"
                )
            gpus = sorted({by_uuid[d] for d in creq.devices_ids}, key=lambda g: g.index)
            response.container_responses.append(self._container_response(gpus))
        return response

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    # -- helpers --------------------------------------------------------------

    def _container_response(self, gpus: list[GpuInfo]) -> pb.ContainerAllocateResponse:
        out = pb.ContainerAllocateResponse()
        if not gpus:
            return out
        out.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in gpus)
        out.envs["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
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
            self.backend, dev_dir=self.dev_dir, poll_interval_s=self.poll_interval_s
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
