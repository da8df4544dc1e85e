"""agent/inventory.py: a host's inventory from a fake root (sysfs, procfs,
os-release) and a stand-in ``pynvml``."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from gpuclusters.agent import inventory
from gpuclusters.agent.inventory import catalog_gpu_type, collect, gpu_model
from gpuclusters.core.catalog import GPU_TYPES


class FakeNvmlError(Exception):
    pass


def fake_nvml(names: list[str], *, init_error: bool = False, lost: int | None = None) -> Any:
    m: Any = types.ModuleType("pynvml")
    m.NVMLError = FakeNvmlError
    m.shutdown = False

    def init() -> None:
        if init_error:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def handle(i: int) -> int:
        if i == lost:
            raise FakeNvmlError("GPU is lost")
        return i

    m.nvmlInit = init
    m.nvmlShutdown = lambda: setattr(m, "shutdown", True)
    m.nvmlSystemGetDriverVersion = lambda: b"550.127.05"
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetName = lambda h: names[h].encode()
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=81559 * 1024**2)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h:08x}-aaaa-bbbb-cccc-dddddddddddd"
    return m


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    block = tmp_path / "sys" / "block"
    for name, sectors, model in (
        ("nvme0n1", 7501476528, "SAMSUNG MZQL27T6HBLA-00A07"),  # 3.84 TB = 3577.0 GiB
        ("nvme1n1", 7501476528, "SAMSUNG MZQL27T6HBLA-00A07"),
    ):
        write(block / name / "size", f"{sectors}\n")
        write(block / name / "device" / "model", model + "    \n")
    write(block / "nvme0n1p1" / "size", "2048\n")  # partition: not listed
    write(block / "sda" / "size", "1000000\n")  # not NVMe
    write(block / "nvme2n1" / "size", "0\n")  # a namespace without media
    ib = tmp_path / "sys" / "class" / "infiniband"
    for dev, port, state, phys, rate, layer in (
        ("mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"),
        ("mlx5_1", 1, "1: DOWN", "3: Disabled", "10 Gb/sec (4X SDR)", "InfiniBand"),
        ("mlx5_bond_0", 1, "4: ACTIVE", "5: LinkUp", "200 Gb/sec (2X HDR)", "Ethernet"),
    ):
        d = ib / dev / "ports" / str(port)
        write(d / "state", state + "\n")
        write(d / "phys_state", phys + "\n")
        write(d / "rate", rate + "\n")
        write(d / "link_layer", layer + "\n")
    write(
        tmp_path / "proc" / "meminfo",
        "MemTotal:       2113506204 kB\nMemFree:        2000000000 kB\n",
    )
    write(
        tmp_path / "proc" / "cpuinfo",
        "".join(f"processor\t: {i}\nmodel name\t: Intel Xeon\n\n" for i in range(224)),
    )
    write(tmp_path / "proc" / "sys" / "kernel" / "osrelease", "6.8.0-51-generic\n")
    write(
        tmp_path / "etc" / "os-release",
        'NAME="Ubuntu"\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.5 LTS"\nID=ubuntu\n',
    )
    return tmp_path


def test_inventory_of_an_h100_host(root: Path) -> None:
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"] * 8)
    inv = collect(root, nvml=nvml)
    assert inv.gpu_count == 8 and inv.gpu_model == "H100_SXM"
    assert inv.driver_version == "550.127.05"
    assert inv.gpus[3].uuid == "GPU-00000003-aaaa-bbbb-cccc-dddddddddddd"
    assert inv.gpus[0].memory_mib == 81559 and inv.gpus[0].model == "NVIDIA H100 80GB HBM3"
    assert nvml.shutdown
    assert [(n.name, n.size_gib, n.model) for n in inv.nvme] == [
        ("nvme0n1", 3577.0, "SAMSUNG MZQL27T6HBLA-00A07"),
        ("nvme1n1", 3577.0, "SAMSUNG MZQL27T6HBLA-00A07"),
    ]
    assert inv.nvme_gib == 7154.0
    assert [
        (p.device, p.port, p.state, p.phys_state, p.rate, p.link_layer) for p in inv.infiniband
    ][:2] == [
        ("mlx5_0", 1, "ACTIVE", "LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"),
        ("mlx5_1", 1, "DOWN", "Disabled", "10 Gb/sec (4X SDR)", "InfiniBand"),
    ]
    assert inv.infiniband[2].link_layer == "Ethernet"
    assert inv.cpus == 224 and inv.memory_gib == 2015.6
    assert inv.kernel == "6.8.0-51-generic" and inv.os == "Ubuntu 22.04.5 LTS"


def test_to_json_is_plain_json(root: Path) -> None:
    data = collect(root, nvml=fake_nvml(["NVIDIA H200"] * 2)).to_json()
    again = json.loads(json.dumps(data))
    assert again["gpu_model"] == "H200_SXM"
    assert again["gpus"][1] == {
        "index": 1,
        "uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
        "model": "NVIDIA H200",
        "memory_mib": 81559,
    }
    assert again["nvme"][0]["name"] == "nvme0n1"
    assert set(again["infiniband"][0]) == {
        "device",
        "port",
        "state",
        "phys_state",
        "rate",
        "link_layer",
    }


def test_without_nvml_the_rest_still_comes(root: Path) -> None:
    for nvml in (None, fake_nvml(["NVIDIA H100 80GB HBM3"], init_error=True)):
        inv = collect(root, nvml=nvml)
        assert inv.gpus == [] and inv.gpu_count == 0 and inv.gpu_model is None
        assert inv.driver_version is None
        assert inv.nvme_gib == 7154.0 and inv.cpus == 224


def test_a_gpu_nvml_cannot_read_is_left_out(root: Path) -> None:
    inv = collect(root, nvml=fake_nvml(["NVIDIA B200"] * 8, lost=5))
    assert inv.gpu_count == 7 and 5 not in [g.index for g in inv.gpus]
    assert inv.gpu_model == "B200_SXM"


def test_an_empty_root_gives_an_empty_inventory(tmp_path: Path) -> None:
    inv = collect(tmp_path, nvml=None)
    assert inv.nvme == [] and inv.infiniband == [] and inv.cpus == 0
    assert inv.memory_gib == 0.0 and inv.kernel == "" and inv.os == ""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100_SXM"),
        ("NVIDIA H200", "H200_SXM"),
        ("NVIDIA B200", "B200_SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100_SXM"),
        # Other boards of the same chips are other products.
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_catalog_names(name: str, expected: str | None) -> None:
    assert catalog_gpu_type(name) == expected
    if expected is not None:
        assert expected in GPU_TYPES


def test_gpu_model_of_unknown_and_mixed_hosts() -> None:
    assert gpu_model(["NVIDIA L40S"] * 4) == "NVIDIA L40S"
    assert gpu_model(["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"]) == (
        "NVIDIA H100 80GB HBM3+NVIDIA H100 PCIe"
    )
    assert gpu_model([]) is None


def test_collect_on_this_machine_does_not_fail() -> None:
    inv = inventory.collect(nvml=None)
    assert inv.cpus > 0 and inv.memory_gib > 0 and inv.kernel
