"""What a GPU host has: the inventory a host agent reports.

Where the node agent (``agent/__main__``) describes one node's GPUs, this
describes the machine a node runs on, so the control plane can register it
as a fleet host: GPUs (model, memory, UUIDs) and the catalog type they
amount to, local NVMe, InfiniBand ports, CPUs, memory, kernel, OS and driver.

Sources, all read-only and cheap (well under a second):

* GPUs and the driver version through NVML (``pynvml``); without NVML
  (no driver, no library) the GPU list is empty and the rest still comes.
* NVMe namespaces from ``/sys/block/nvme*n*`` (``size`` is in 512-byte
  sectors whatever the device's block size; partitions are
  ``nvme0n1p1`` and are not listed), the model from ``device/model``.
* InfiniBand ports from ``/sys/class/infiniband/<dev>/ports/<n>/``:
  ``state`` and ``phys_state`` read ``"4: ACTIVE"`` / ``"5: LinkUp"`` (the
  name is kept), ``rate`` reads ``"400 Gb/sec (4X NDR)"``, ``link_layer``
  ``InfiniBand`` or ``Ethernet`` (RoCE).
* ``/proc/meminfo``, ``/proc/cpuinfo``, ``/proc/sys/kernel/osrelease``,
  ``/etc/os-release``.

Every path is taken below ``root`` so tests build fake trees; NVML is
injectable the same way (``nvml=``). The agent is a separate program: this
module imports nothing of the server's, only ``core``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

MIB = 1024**2
GIB = 1024**3
SECTOR = 512  # /sys/block/*/size counts 512-byte units whatever the block size

# NVML's product names of the GPU types in core.catalog (all SXM parts: the
# PCIe and NVL boards are different products, with other figures, and stay
# under their own names). Examples: "NVIDIA H100 80GB HBM3", "NVIDIA H200",
# "NVIDIA B200", "NVIDIA A100-SXM4-80GB".
_CATALOG_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^NVIDIA H100 80GB HBM3$|^NVIDIA H100 SXM5? 80GB$"), "H100_SXM"),
    (re.compile(r"^NVIDIA H200(?: 141GB HBM3e)?$"), "H200_SXM"),
    (re.compile(r"^NVIDIA B200(?: 180GB HBM3e)?$"), "B200_SXM"),
    (re.compile(r"^NVIDIA A100-SXM4-80GB$"), "A100_SXM"),
)
_NVME_NAMESPACE = re.compile(r"^nvme\d+n\d+$")
_PORT_STATE = re.compile(r"^\s*\d+:\s*(\S.*?)\s*$")


@dataclass(frozen=True, slots=True)
class GpuEntry:
    index: int
    uuid: str
    model: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class NvmeEntry:
    name: str
    size_gib: float
    model: str


@dataclass(frozen=True, slots=True)
class IbPort:
    device: str
    port: int
    state: str
    phys_state: str
    rate: str
    link_layer: str


@dataclass(slots=True)
class HostInventory:
    """One host's hardware and software, as the host agent reports it."""

    gpus: list[GpuEntry] = field(default_factory=list)
    gpu_model: str | None = None
    gpu_count: int = 0
    driver_version: str | None = None
    nvme: list[NvmeEntry] = field(default_factory=list)
    nvme_gib: float = 0.0
    infiniband: list[IbPort] = field(default_factory=list)
    cpus: int = 0
    memory_gib: float = 0.0
    kernel: str = ""
    os: str = ""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (lists of dicts for the entries)."""
        return asdict(self)


# -- GPUs ----------------------------------------------------------------------------------


def catalog_gpu_type(name: str) -> str | None:
    """The catalog's GPU type of an NVML product name; None if none fits."""
    for pattern, gpu_type in _CATALOG_NAMES:
        if pattern.match(name.strip()):
            return gpu_type
    return None


def gpu_model(names: list[str]) -> str | None:
    """The model shared by all GPUs: the catalog type when one fits, else
    the raw NVML name; None without GPUs; a mixed host reports its names
    joined by ``+`` (such a host cannot be one catalog type)."""
    distinct = sorted(set(names))
    if not distinct:
        return None
    if len(distinct) > 1:
        return "+".join(distinct)
    return catalog_gpu_type(distinct[0]) or distinct[0]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    module: ModuleType = pynvml
    return module


def nvml_gpus(nvml: ModuleType | None) -> tuple[list[GpuEntry], str | None]:
    """The GPUs and driver version NVML reports; ([], None) when NVML cannot
    start (no driver, no libnvidia-ml). A GPU NVML cannot read is left out
    (the node agent's health reporting is where a lost GPU shows)."""
    if nvml is None:
        return [], None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and friends: no usable NVML
        log.info("NVML unavailable: %s", exc)
        return [], None
    gpus: list[GpuEntry] = []
    version: str | None = None
    try:
        try:
            version = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            log.info("NVML has no driver version: %s", exc)
        for i in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(
                    GpuEntry(
                        index=i,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        model=_text(nvml.nvmlDeviceGetName(handle)),
                        memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                    )
                )
            except nvml.NVMLError as exc:
                log.warning("GPU %d does not answer NVML: %s", i, exc)
    except nvml.NVMLError as exc:
        log.warning("NVML failed: %s", exc)
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    return gpus, version


# -- files ---------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def nvme_devices(root: Path = Path("/")) -> list[NvmeEntry]:
    """NVMe namespaces (``nvme0n1``...; not partitions, not the ``nvme0``
    controllers) with their size and model."""
    block = _under(root, "/sys/block")
    out = []
    try:
        names = sorted(p.name for p in block.iterdir())
    except OSError:
        return []
    for name in names:
        if not _NVME_NAMESPACE.match(name):
            continue
        size = _read(block / name / "size")
        try:
            sectors = int(size or "0")
        except ValueError:
            continue
        if sectors <= 0:
            continue
        model = _read(block / name / "device" / "model") or ""
        out.append(NvmeEntry(name, round(sectors * SECTOR / GIB, 1), model))
    return out


def _port_state(text: str | None) -> str:
    if text is None:
        return ""
    m = _PORT_STATE.match(text)
    return m.group(1) if m else text


def infiniband_ports(root: Path = Path("/")) -> list[IbPort]:
    """Every port of every RDMA device (InfiniBand, or RoCE when the link
    layer says Ethernet)."""
    base = _under(root, "/sys/class/infiniband")
    out = []
    try:
        devices = sorted(p.name for p in base.iterdir())
    except OSError:
        return []
    for dev in devices:
        ports_dir = base / dev / "ports"
        try:
            ports = sorted(int(p.name) for p in ports_dir.iterdir() if p.name.isdigit())
        except OSError:
            continue
        for port in ports:
            d = ports_dir / str(port)
            out.append(
                IbPort(
                    device=dev,
                    port=port,
                    state=_port_state(_read(d / "state")),
                    phys_state=_port_state(_read(d / "phys_state")),
                    rate=_read(d / "rate") or "",
                    link_layer=_read(d / "link_layer") or "",
                )
            )
    return out


def memory_gib(root: Path = Path("/")) -> float:
    text = _read(_under(root, "/proc/meminfo")) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            kib = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            return round(kib * 1024 / GIB, 1)
    return 0.0


def cpu_count(root: Path = Path("/")) -> int:
    """Logical CPUs: ``processor`` lines of /proc/cpuinfo (the host's, even
    when this process is confined to fewer), else os.cpu_count()."""
    text = _read(_under(root, "/proc/cpuinfo"))
    if text:
        n = sum(1 for line in text.splitlines() if re.match(r"^processor\s*:", line))
        if n:
            return n
    return (os.cpu_count() or 0) if root == Path("/") else 0


def kernel_release(root: Path = Path("/")) -> str:
    release = _read(_under(root, "/proc/sys/kernel/osrelease"))
    if release:
        return release
    return os.uname().release if root == Path("/") else ""


def os_name(root: Path = Path("/")) -> str:
    """PRETTY_NAME of /etc/os-release (else /usr/lib/os-release)."""
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        text = _read(_under(root, path))
        if text is None:
            continue
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() == "PRETTY_NAME":
                return value.strip().strip("\"'")
    return ""


def collect(root: Path = Path("/"), *, nvml: ModuleType | bool | None = True) -> HostInventory:
    """This host's inventory. ``nvml``: a ``pynvml``-like module, True to
    import pynvml (the default), None/False for no GPUs."""
    module = _load_pynvml() if nvml is True else (nvml or None)
    gpus, driver = nvml_gpus(module)
    nvme = nvme_devices(root)
    return HostInventory(
        gpus=gpus,
        gpu_model=gpu_model([g.model for g in gpus]),
        gpu_count=len(gpus),
        driver_version=driver,
        nvme=nvme,
        nvme_gib=round(sum(n.size_gib for n in nvme), 1),
        infiniband=infiniband_ports(root),
        cpus=cpu_count(root),
        memory_gib=memory_gib(root),
        kernel=kernel_release(root),
        os=os_name(root),
    )
