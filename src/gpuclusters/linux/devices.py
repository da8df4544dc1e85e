"""What a node needs from the host to use its real GPUs and fabric.

A node of the embedded fleet gets a private ``/dev`` (a tmpfs) and the host's
``/usr`` (and every other shared top-level directory) read-only; see
:mod:`._nsinit`. On a host with NVIDIA GPUs the node must also see the real
device nodes and whatever of the driver is not already visible through the
shared directories. :class:`DeviceSet` is that list, built one of two ways:

* from the NVIDIA Container Toolkit's CDI spec (``nvidia-ctk cdi generate``,
  :func:`from_cdi_spec`): the toolkit knows the driver best (versioned
  libraries, GSP firmware, IPC sockets, MIG capability nodes), so its spec is
  preferred when the tool is installed;
* by discovery (:func:`discover`) where it is not: the same rules the toolkit
  applies, reduced to what a node needs: ``/dev/nvidia<N>`` and the control
  nodes, driver libraries from ``ldconfig -p`` (the toolkit's rule: every
  library in the cache whose name ends in ``.so.<driver version>``, plus
  ``libnvidia-nvvm70``), the driver's tools (nvidia-smi ...), GSP firmware and
  the persistenced / fabric manager sockets.

InfiniBand device nodes (``/dev/infiniband/*``) are added either way; a host
with a fabric but no GPUs still gets a set (:func:`fabric_devices`).

Paths: ``device_nodes`` are host paths below ``dev_root`` (``/dev`` on a real
host; another directory in tests or with a containerised driver, whose CDI
spec names ``hostPath`` ``/run/nvidia/driver/dev/...``), each shown in the
node at the same place below ``/dev``. ``mounts`` pair a host path with the
path the node sees it at; :mod:`._nsinit` binds only those the node cannot
already see (on a host with the driver installed in ``/usr``: the sockets
under ``/run``, nothing else).

``library_dirs`` are the CDI spec's ``update-ldcache`` folders: hooks are not
run (no container runtime is involved); the node's linker cache is the
host's ``/etc/ld.so.cache`` through its ``/etc`` overlay, and ``_nsinit`` runs
``ldconfig`` in the node only if it had to bind a library into one of them.

A node booting from the node image (linux/nodeimage.py) cannot take the
driver at its own paths: its ``/usr`` is the image's, read-only and shared
by every node, and knows no driver. :meth:`DeviceSet.relocated` moves the
driver's files below :data:`DRIVER_ROOT` in the node (its own tmpfs,
the layout NVIDIA's GPU Operator uses for a containerised driver):
libraries and firmware at their host path below it, the driver's tools
flat in ``<root>/bin``, which the image links from ``/usr/local/bin``
(scripts/build-node-image). ``_nsinit`` then lists the relocated library
folders in ``/etc/ld.so.conf.d`` and runs ``ldconfig``, and the device plugin
still gives containers every file at the path the driver put it on the
host (``container_path``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SOURCE_CDI = "cdi"
SOURCE_DISCOVERED = "discovered"

# Control nodes besides /dev/nvidia<N>; the UVM ones exist once nvidia-uvm is
# loaded (nvidia-modprobe makes them, see host_devices), modeset with
# nvidia-modeset.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# Directories of device nodes taken whole where they exist: MIG capabilities,
# IMEX channels (multi-node NVLink), InfiniBand verbs / RDMA CM / umad.
CAPS_DIRS = ("nvidia-caps", "nvidia-caps-imex-channels")
INFINIBAND_DIR = "infiniband"
_GPU_NODE = re.compile(r"^nvidia(\d+)$")

# The driver's tools, as the toolkit's newDriverBinariesDiscoverer lists them.
DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
# Where a node booting from the node image sees the driver's files
# (DeviceSet.relocated); the image links <root>/bin/<tool> from /usr/local/bin.
DRIVER_ROOT = "/run/nvidia/driver"
DEFAULT_BIN_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
# The toolkit's IPC discoverer: daemons on the host that node processes talk
# to. The node's /run is its own tmpfs, so these are the mounts that matter.
IPC_SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")

# Driver libraries when the driver version is unknown (the toolkit's rule
# needs it): the families the NVIDIA driver installs. libnvidia-container is
# the toolkit's own library, not the driver's.
_DRIVER_LIB = re.compile(
    r"^(libcuda|libcudadebugger|libnvcuvid|libnvoptix|libnvidia-[A-Za-z0-9_.-]+?"
    r"|lib(?:GLX|EGL|GLESv2|GLESv1_CM)_nvidia|libvdpau_nvidia)\.so(\.[0-9.]+)?$"
)
_NOT_DRIVER = ("libnvidia-container", "libnvidia-egl-wayland", "libnvidia-egl-gbm")
_NVVM70 = re.compile(r"^libnvidia-nvvm70\.so(\.|$)")
# One line of `ldconfig -p`: "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/.../libcuda.so.1"
_LDCONFIG_LINE = re.compile(r"^\s+(\S+)\s+\(([^)]*)\)\s+=>\s+(\S.*)$")
_DRIVER_VERSION = re.compile(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s")


class CdiSpecError(ValueError):
    """A CDI spec this module cannot use (not NVIDIA's, or malformed)."""


@dataclass(frozen=True, slots=True)
class DeviceSet:
    """The host's GPU and fabric devices, as a node is to see them."""

    device_nodes: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    gpu_count: int = 0
    source: str = SOURCE_DISCOVERED
    dev_root: str = "/dev"
    library_dirs: tuple[str, ...] = ()
    # Set by relocated(): the node sees the driver's files below it.
    driver_root: str | None = None

    def __post_init__(self) -> None:
        root = self.dev_root.rstrip("/") or "/"
        if not root.startswith("/"):
            raise ValueError(f"dev_root must be absolute: {self.dev_root!r}")
        for path in self.device_nodes:
            if not path.startswith(root + "/") or ".." in path.split("/"):
                raise ValueError(f"device node {path!r} is not below {root}")
        for host, node in self.mounts:
            for p in (host, node):
                if not p.startswith("/") or ".." in p.split("/"):
                    raise ValueError(f"mount path {p!r} must be absolute and without '..'")

    def node_path(self, device: str) -> str:
        """Where the node sees host device node ``device``: same place below /dev."""
        return "/dev/" + device[len(self.dev_root.rstrip("/")) + 1 :]

    def node_mount_path(self, path: str) -> str:
        """Where the node sees a driver file its containers get at ``path``:
        ``path`` itself, or below :attr:`driver_root` once relocated (the
        driver's tools flat in ``<root>/bin``). Sockets under /run and nodes
        under /dev stay: the node's /run and /dev are its own to place them in."""
        root = self.driver_root
        if root is None or path.startswith(("/run/", "/dev/")):
            return path
        name = os.path.basename(path)
        if name in DRIVER_BINARIES:
            return f"{root}/bin/{name}"
        return root + path

    def relocated(self, root: str = DRIVER_ROOT) -> DeviceSet:
        """This set for nodes that boot from the node image: the driver's
        files go below ``root`` in the node (see the module docstring)."""
        if not root.startswith("/run/") or ".." in root.split("/"):
            raise ValueError(f"driver root {root!r} must be below /run (the node's own tmpfs)")
        return replace(self, driver_root=root.rstrip("/"))

    def merged(self, other: DeviceSet) -> DeviceSet:
        """This set plus ``other``'s device nodes and mounts (same dev_root)."""
        if other.dev_root.rstrip("/") != self.dev_root.rstrip("/"):
            raise ValueError("cannot merge device sets with different dev roots")
        return replace(
            self,
            device_nodes=_unique([*self.device_nodes, *other.device_nodes]),
            mounts=_unique([*self.mounts, *other.mounts]),
            env={**other.env, **self.env},
            gpu_count=max(self.gpu_count, other.gpu_count),
            library_dirs=_unique([*self.library_dirs, *other.library_dirs]),
        )

    def to_nsinit(self) -> dict[str, Any]:
        """The marshal-able form ``_nsinit`` reads (plain lists and strings),
        with node-side paths."""
        out: dict[str, Any] = {
            "nodes": [[path, self.node_path(path)] for path in self.device_nodes],
            "mounts": [[host, self.node_mount_path(node)] for host, node in self.mounts],
            "library_dirs": [self.node_mount_path(d) for d in self.library_dirs],
            "gpu_count": self.gpu_count,
        }
        if self.driver_root is not None:
            out["driver_root"] = self.driver_root
        return out

    def to_node_info(self) -> dict[str, Any]:
        """What node.json's ``devices`` says, for the node agent's device
        plugin: the device nodes as the node sees them, each driver file as
        [host path, node path, container path] and the library folders as
        containers see them."""
        return {
            "device_nodes": [self.node_path(p) for p in self.device_nodes],
            "mounts": [[host, self.node_mount_path(node), node] for host, node in self.mounts],
            "library_dirs": list(self.library_dirs),
            "driver_root": self.driver_root,
        }


def _unique(items: Iterable[_T]) -> tuple[_T, ...]:
    return tuple(dict.fromkeys(items))


# -- CDI -----------------------------------------------------------------------------------


def _edits_of(obj: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    edits = obj.get("containerEdits") or {}
    if not isinstance(edits, Mapping):
        raise CdiSpecError(f"{what}: containerEdits is not a mapping")
    return edits


def _ldcache_folders(hooks: Any) -> list[str]:
    """The ``--folder`` arguments of ``update-ldcache`` hooks (both the
    ``nvidia-cdi-hook update-ldcache`` and the older ``nvidia-ctk hook
    update-ldcache`` forms); every other hook is ignored."""
    folders: list[str] = []
    for hook in hooks or ():
        args = [str(a) for a in (hook.get("args") or ())] if isinstance(hook, Mapping) else []
        if "update-ldcache" not in args:
            continue
        for i, arg in enumerate(args):
            if arg == "--folder" and i + 1 < len(args):
                folders.append(args[i + 1])
            elif arg.startswith("--folder="):
                folders.append(arg.split("=", 1)[1])
    return folders


def from_cdi_spec(spec: Mapping[str, Any], *, fabric_root: str | None = "/dev") -> DeviceSet:
    """The device set of an NVIDIA CDI spec (``kind: nvidia.com/gpu``).

    Device nodes are the union of every device's (``all`` is that union
    already; the per-index and per-UUID entries repeat it) and the common
    edits'; mounts and env come from both too. Hooks are not run (see the
    module docstring). ``fabric_root``: also add the InfiniBand device nodes
    found below it (None: do not look)."""
    kind = spec.get("kind")
    if not isinstance(kind, str) or not kind.startswith("nvidia.com/"):
        raise CdiSpecError(f"not an NVIDIA CDI spec (kind {kind!r})")
    devices = spec.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, Mapping) for d in devices):
        raise CdiSpecError("devices is not a list of mappings")
    edits = [_edits_of(spec, "spec")]
    edits += [_edits_of(d, f"device {d.get('name')!r}") for d in devices]

    pairs: list[tuple[str, str]] = []  # (host path, node path)
    mounts: list[tuple[str, str]] = []
    env: dict[str, str] = {}
    folders: list[str] = []
    try:
        for e in edits:
            for dn in e.get("deviceNodes") or ():
                path = str(dn["path"])
                pairs.append((str(dn.get("hostPath") or path), path))
            for m in e.get("mounts") or ():
                mounts.append((str(m["hostPath"]), str(m["containerPath"])))
            for item in e.get("env") or ():
                key, sep, value = str(item).partition("=")
                if sep:
                    env[key] = value
            folders += _ldcache_folders(e.get("hooks"))
    except (KeyError, TypeError, AttributeError) as exc:
        raise CdiSpecError(f"malformed containerEdits: {exc!r}") from exc

    dev_root = _dev_root_of(pairs)
    gpus = {node for _, node in pairs if _GPU_NODE.match(os.path.basename(node))}
    try:
        found = DeviceSet(
            device_nodes=_unique(host for host, _ in pairs),
            mounts=_unique(mounts),
            env=env,
            gpu_count=len(gpus),
            source=SOURCE_CDI,
            dev_root=dev_root,
            library_dirs=_unique(folders),
        )
    except ValueError as exc:
        raise CdiSpecError(str(exc)) from exc
    if fabric_root is not None and fabric_root.rstrip("/") == dev_root.rstrip("/"):
        fabric = fabric_devices(fabric_root)
        if fabric is not None:
            found = found.merged(fabric)
    return found


def _dev_root_of(pairs: Sequence[tuple[str, str]]) -> str:
    """The host directory standing for the node's /dev: /dev, unless the spec
    says ``hostPath: <root>/dev/x`` for ``path: /dev/x`` (a driver container's
    dev root), the same root for every node."""
    roots = set()
    for host, node in pairs:
        if not node.startswith("/dev/"):
            raise CdiSpecError(f"device node {node!r} is not below /dev")
        if not host.endswith(node):
            raise CdiSpecError(f"device node {node!r} comes from {host!r}: not the same name")
        roots.add(host[: len(host) - len(node)] + "/dev")
    if len(roots) > 1:
        raise CdiSpecError(f"device nodes come from several dev roots: {sorted(roots)}")
    return roots.pop() if roots else "/dev"


def load_cdi_spec(text: str) -> dict[str, Any]:
    """A CDI spec from its JSON or YAML text (``/etc/cdi/nvidia.yaml``)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise CdiSpecError("a CDI spec is a mapping")
    return data


def generate_cdi_spec(nvidia_ctk: str, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``nvidia-ctk cdi generate --format=json`` (to stdout) and parse it.
    Raises ``CdiSpecError`` (or OSError/subprocess errors) when it fails."""
    done = subprocess.run(
        [nvidia_ctk, "cdi", "generate", "--format=json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        tail = done.stderr.strip()[-500:]
        raise CdiSpecError(f"nvidia-ctk cdi generate exited {done.returncode}: {tail}")
    return load_cdi_spec(done.stdout)


# -- discovery -----------------------------------------------------------------------------


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _char_devices_in(directory: str, *, char_only: bool) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    paths = [os.path.join(directory, n) for n in names]
    return [p for p in paths if os.path.exists(p) and (not char_only or _is_char_device(p))]


def fabric_devices(dev_root: str = "/dev", *, char_only: bool = True) -> DeviceSet | None:
    """The host's InfiniBand device nodes (``<dev_root>/infiniband/*``:
    uverbs, rdma_cm, umad, issm) as a GPU-less set; None when there are none."""
    nodes = _char_devices_in(os.path.join(dev_root, INFINIBAND_DIR), char_only=char_only)
    if not nodes:
        return None
    return DeviceSet(device_nodes=tuple(nodes), dev_root=dev_root)


def parse_ldconfig(output: str) -> list[tuple[str, str]]:
    """``(name, path)`` of the 64-bit libraries in ``ldconfig -p`` output
    (32-bit compat libraries are not for the node's programs)."""
    out = []
    for line in output.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and "64" in m.group(2):
            out.append((m.group(1), m.group(3).strip()))
    return out


def driver_version(sys_root: str = "/sys", proc_root: str = "/proc") -> str | None:
    """The loaded kernel module's version (what the toolkit matches library
    names against): /sys/module/nvidia/version, else /proc/driver/nvidia/version."""
    try:
        version = Path(sys_root, "module/nvidia/version").read_text().strip()
        if version:
            return version
    except OSError:
        pass
    try:
        m = _DRIVER_VERSION.search(Path(proc_root, "driver/nvidia/version").read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def driver_libraries(ldconfig_output: str, version: str | None) -> list[str]:
    """The driver's libraries in the linker cache, with the files their
    names link to. With the version: the toolkit's rule (real file named
    ``*.so.<version>``, plus libnvidia-nvvm70); without it: by family name."""
    out: list[str] = []
    for name, path in parse_ldconfig(ldconfig_output):
        real = os.path.realpath(path)
        base = os.path.basename(real)
        if version is not None:
            wanted = base.endswith(".so." + version) or bool(_NVVM70.match(name))
        else:
            wanted = bool(_DRIVER_LIB.match(name)) and not name.startswith(_NOT_DRIVER)
        if wanted:
            out += [path, real] if real != path and os.path.exists(real) else [path]
    return list(_unique(out))


def _ldconfig_output() -> str:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        done = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("ldconfig -p failed: %s", exc)
        return ""
    return done.stdout


def _firmware(version: str | None, firmware_dirs: Sequence[str]) -> list[str]:
    """GSP firmware of this driver version (the toolkit mounts it too)."""
    if version is None:
        return []
    for base in firmware_dirs:
        d = os.path.join(base, "nvidia", version)
        try:
            names = sorted(n for n in os.listdir(d) if n.startswith("gsp") and n.endswith(".bin"))
        except OSError:
            continue
        if names:
            return [os.path.join(d, n) for n in names]
    return []


def discover(
    dev_root: str = "/dev",
    ldconfig_output: str | None = None,
    bin_dirs: Sequence[str] = DEFAULT_BIN_DIRS,
    *,
    sys_root: str = "/sys",
    proc_root: str = "/proc",
    firmware_dirs: Sequence[str] = ("/lib/firmware/updates", "/lib/firmware"),
    ipc_sockets: Sequence[str] = IPC_SOCKETS,
    char_only: bool = True,
) -> DeviceSet | None:
    """The host's GPUs without the toolkit; None when there is no
    ``<dev_root>/nvidia0`` (a host without NVIDIA GPUs: nodes keep the
    simulated devices). ``ldconfig_output`` is ``ldconfig -p``'s (run when
    None). ``char_only=False`` accepts plain files as device nodes (tests)."""
    gpu_nodes = []
    for path in _char_devices_in(dev_root, char_only=char_only):
        m = _GPU_NODE.match(os.path.basename(path))
        if m:
            gpu_nodes.append((int(m.group(1)), path))
    if not any(minor == 0 for minor, _ in gpu_nodes):
        return None
    nodes = [p for _, p in sorted(gpu_nodes)]
    for name in CONTROL_NODES:
        path = os.path.join(dev_root, name)
        if os.path.exists(path) and (not char_only or _is_char_device(path)):
            nodes.append(path)
    for name in CAPS_DIRS:
        nodes += _char_devices_in(os.path.join(dev_root, name), char_only=char_only)

    version = driver_version(sys_root, proc_root)
    if ldconfig_output is None:
        ldconfig_output = _ldconfig_output()
    libraries = driver_libraries(ldconfig_output, version)
    files = list(libraries)
    for name in DRIVER_BINARIES:
        for d in bin_dirs:
            path = os.path.join(d, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                files.append(path)
                break
    files += _firmware(version, firmware_dirs)
    files += [p for p in ipc_sockets if os.path.exists(p)]
    lib_dirs = _unique(os.path.dirname(p) for p in libraries)
    found = DeviceSet(
        device_nodes=tuple(nodes),
        mounts=tuple((p, p) for p in _unique(files)),
        gpu_count=len(gpu_nodes),
        source=SOURCE_DISCOVERED,
        dev_root=dev_root,
        library_dirs=lib_dirs,
    )
    fabric = fabric_devices(dev_root, char_only=char_only)
    return found.merged(fabric) if fabric is not None else found


def _ensure_uvm_nodes(dev_root: str) -> None:
    """Make /dev/nvidia-uvm{,-tools} if the driver has not yet (it does on
    the first CUDA call). Nodes get a copy of /dev made at boot, so a device
    node that appears on the host later never reaches them."""
    if dev_root != "/dev" or os.path.exists("/dev/nvidia-uvm"):
        return
    modprobe = shutil.which("nvidia-modprobe")
    if modprobe is None:
        return
    try:
        subprocess.run(
            [modprobe, "-u", "-c=0"], capture_output=True, timeout=30, check=False
        )  # loads nvidia-uvm and makes its nodes (and nvidia0's)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("nvidia-modprobe failed: %s", exc)


def host_devices(
    nvidia_ctk: str | None = "nvidia-ctk",
    *,
    dev_root: str = "/dev",
    ensure_uvm: bool = True,
) -> DeviceSet | None:
    """The host's GPU (and fabric) devices for its nodes: from ``nvidia-ctk
    cdi generate`` when ``nvidia_ctk`` (a path, or a name looked up on PATH)
    is installed, else :func:`discover`; the InfiniBand nodes either way.
    None when the host has neither GPUs nor a fabric. Blocking (runs
    programs): call it from a thread in async code."""
    if ensure_uvm:
        _ensure_uvm_nodes(dev_root)
    ctk = shutil.which(nvidia_ctk) if nvidia_ctk else None
    if ctk is not None and os.path.exists(os.path.join(dev_root, "nvidia0")):
        try:
            found = from_cdi_spec(generate_cdi_spec(ctk), fabric_root=dev_root)
        except (CdiSpecError, OSError, subprocess.SubprocessError) as exc:
            log.warning("nvidia-ctk cdi generate unusable (%s); discovering devices", exc)
        else:
            if found.gpu_count:
                return found
            log.warning("nvidia-ctk's CDI spec lists no GPU; discovering devices")
    return discover(dev_root) or fabric_devices(dev_root)
