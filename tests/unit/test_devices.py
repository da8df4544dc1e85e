"""linux/devices.py: a node's real GPU and fabric devices, from an NVIDIA
CDI spec (a sample in nvidia-ctk's output format) or discovered in a fake
/dev, ldconfig output, bin dirs and sysfs."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import yaml

from gpuclusters.linux import devices
from gpuclusters.linux.devices import CdiSpecError, DeviceSet, discover, from_cdi_spec

DATA = Path(__file__).parent / "data"
# Device nodes are made with mknod as root; elsewhere they are plain files and
# discovery is told to accept those.
ROOT = os.geteuid() == 0
VERSION = "550.127.05"
LIB = "/usr/lib/x86_64-linux-gnu"


def sample_spec() -> dict[str, object]:
    data: dict[str, object] = json.loads((DATA / "nvidia-cdi-h100x8.json").read_text())
    return data


def test_cdi_spec_gives_every_gpu_the_control_nodes_and_the_driver_files() -> None:
    ds = from_cdi_spec(sample_spec(), fabric_root=None)
    assert ds.source == "cdi" and ds.gpu_count == 8 and ds.dev_root == "/dev"
    # The per-index, per-UUID and "all" entries repeat each other: one of each.
    gpus = [f"/dev/nvidia{i}" for i in range(8)]
    assert [p for p in ds.device_nodes if p in gpus] == gpus
    assert set(ds.device_nodes) == {
        *gpus,
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidiactl",
    }
    mounts = dict(ds.mounts)
    assert mounts[f"{LIB}/libcuda.so.{VERSION}"] == f"{LIB}/libcuda.so.{VERSION}"
    assert mounts["/usr/bin/nvidia-smi"] == "/usr/bin/nvidia-smi"
    assert mounts["/run/nvidia-persistenced/socket"] == "/run/nvidia-persistenced/socket"
    assert f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in mounts
    # A file the node sees at another path than the host's.
    assert mounts["/usr/share/vulkan/icd.d/nvidia_icd.json"] == "/etc/vulkan/icd.d/nvidia_icd.json"
    assert ds.env["NVIDIA_CTK_LIBCUDA_DIR"] == LIB
    assert ds.library_dirs == (LIB,)  # hooks: only update-ldcache's folders are kept


def test_cdi_spec_in_yaml_and_the_older_hook_form() -> None:
    text = """
cdiVersion: 0.3.0
kind: nvidia.com/gpu
devices:
- name: gpu0
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: gpu1
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache, --folder=/usr/lib64]
"""
    ds = from_cdi_spec(devices.load_cdi_spec(text), fabric_root=None)
    assert ds.gpu_count == 2 and ds.library_dirs == ("/usr/lib64",)
    assert ds.device_nodes == ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1")
    assert devices.load_cdi_spec(json.dumps(yaml.safe_load(text)))["kind"] == "nvidia.com/gpu"


def test_cdi_spec_of_a_containerised_driver_maps_its_dev_root() -> None:
    root = "/run/nvidia/driver"
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": "all",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": f"{root}/dev/nvidia0"}]
                },
            }
        ],
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl"}],
            "mounts": [
                {
                    "hostPath": f"{root}{LIB}/libcuda.so.{VERSION}",
                    "containerPath": f"{LIB}/libcuda.so.{VERSION}",
                }
            ],
        },
    }
    ds = from_cdi_spec(spec, fabric_root=None)
    assert ds.dev_root == f"{root}/dev"
    assert ds.to_nsinit()["nodes"] == [
        [f"{root}/dev/nvidiactl", "/dev/nvidiactl"],
        [f"{root}/dev/nvidia0", "/dev/nvidia0"],
    ]
    assert ds.mounts == ((f"{root}{LIB}/libcuda.so.{VERSION}", f"{LIB}/libcuda.so.{VERSION}"),)


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "amd.com/gpu", "devices": []},
        {"kind": "nvidia.com/gpu", "devices": {}},
        {
            "kind": "nvidia.com/gpu",
            "containerEdits": {"deviceNodes": [{"path": "/opt/nvidia0"}]},
        },
    ],
)
def test_unusable_cdi_specs_are_refused(spec: dict[str, object]) -> None:
    with pytest.raises(CdiSpecError):
        from_cdi_spec(spec, fabric_root=None)


def test_a_device_set_refuses_paths_outside_its_dev_root() -> None:
    with pytest.raises(ValueError):
        DeviceSet(device_nodes=("/etc/passwd",))
    with pytest.raises(ValueError):
        DeviceSet(device_nodes=("/dev/../etc/passwd",))
    with pytest.raises(ValueError):
        DeviceSet(mounts=(("relative", "/x"),))


# -- discovery in fake trees -------------------------------------------------------------


def char_device(path: Path) -> None:
    """A char device node like /dev/null's (tests run as root), else a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    else:
        path.write_text("")


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    dev, lib, bindir, sys_root = (tmp_path / n for n in ("dev", "lib", "bin", "sys"))
    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm", "null"):
        char_device(dev / name)
    char_device(dev / "nvidia-caps" / "nvidia-cap1")
    char_device(dev / "infiniband" / "uverbs0")
    char_device(dev / "infiniband" / "rdma_cm")
    (dev / "nvidia-fake").write_text("")  # not a char device: ignored
    lib.mkdir()
    for name in (
        f"libcuda.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
        f"libnvidia-ptxjitcompiler.so.{VERSION}",
        "libnvidia-nvvm70.so.4",
        "libnvidia-container.so.1.17.0",
        "libz.so.1.2.13",
    ):
        (lib / name).write_text("")
    for link, target in (
        ("libcuda.so.1", f"libcuda.so.{VERSION}"),
        ("libnvidia-ml.so.1", f"libnvidia-ml.so.{VERSION}"),
        ("libnvidia-container.so.1", "libnvidia-container.so.1.17.0"),
        ("libz.so.1", "libz.so.1.2.13"),
    ):
        (lib / link).symlink_to(target)
    bindir.mkdir()
    for name in ("nvidia-smi", "nvidia-persistenced", "ls"):
        (bindir / name).write_text("#!/bin/sh\n")
        (bindir / name).chmod(0o755)
    (sys_root / "module" / "nvidia").mkdir(parents=True)
    (sys_root / "module" / "nvidia" / "version").write_text(VERSION + "\n")
    firmware = tmp_path / "firmware" / "nvidia" / VERSION
    firmware.mkdir(parents=True)
    (firmware / "gsp_ga10x.bin").write_text("")
    return {"dev": dev, "lib": lib, "bin": bindir, "sys": sys_root, "root": tmp_path}


def ldconfig_output(lib: Path) -> str:
    lines = [f"{len(list(lib.iterdir()))} libs found in cache `/etc/ld.so.cache'"]
    for name in sorted(p.name for p in lib.iterdir()):
        lines.append(f"\t{name} (libc6,x86-64) => {lib / name}")
    # A 32-bit copy: never for the node's programs.
    lines.append("\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1")
    return "\n".join(lines) + "\n"


def test_discover_finds_gpus_control_nodes_caps_fabric_libraries_and_tools(
    host: dict[str, Path],
) -> None:
    dev, lib = host["dev"], host["lib"]
    ds = discover(
        str(dev),
        ldconfig_output(lib),
        [str(host["bin"])],
        sys_root=str(host["sys"]),
        proc_root=str(host["root"] / "proc"),
        firmware_dirs=[str(host["root"] / "firmware")],
        ipc_sockets=[],
        char_only=ROOT,
    )
    assert ds is not None
    assert ds.source == "discovered" and ds.gpu_count == 3
    assert ds.device_nodes == tuple(
        str(dev / n)
        for n in (
            "nvidia0",
            "nvidia1",
            "nvidia10",  # by number, not by name
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-caps/nvidia-cap1",
            "infiniband/rdma_cm",
            "infiniband/uverbs0",
        )
    )
    files = [h for h, n in ds.mounts]
    assert all(h == n for h, n in ds.mounts)
    # The toolkit's rule: files named *.so.<driver version> (and the names
    # linking to them), plus libnvidia-nvvm70; nothing else.
    assert set(files) == {
        str(lib / f"libcuda.so.{VERSION}"),
        str(lib / "libcuda.so.1"),
        str(lib / f"libnvidia-ml.so.{VERSION}"),
        str(lib / "libnvidia-ml.so.1"),
        str(lib / f"libnvidia-ptxjitcompiler.so.{VERSION}"),
        str(lib / "libnvidia-nvvm70.so.4"),
        str(host["bin"] / "nvidia-smi"),
        str(host["bin"] / "nvidia-persistenced"),
        str(host["root"] / "firmware" / "nvidia" / VERSION / "gsp_ga10x.bin"),
    }
    assert ds.library_dirs == (str(lib),)
    assert ds.to_nsinit()["nodes"][0] == [str(dev / "nvidia0"), "/dev/nvidia0"]
    assert ds.to_nsinit()["nodes"][5] == [
        str(dev / "nvidia-caps" / "nvidia-cap1"),
        "/dev/nvidia-caps/nvidia-cap1",
    ]


def test_discover_without_a_driver_version_goes_by_library_family(
    host: dict[str, Path],
) -> None:
    (host["sys"] / "module" / "nvidia" / "version").unlink()
    ds = discover(
        str(host["dev"]),
        ldconfig_output(host["lib"]),
        [str(host["bin"])],
        sys_root=str(host["sys"]),
        proc_root=str(host["root"] / "proc"),
        ipc_sockets=[],
        char_only=ROOT,
    )
    assert ds is not None
    names = {os.path.basename(h) for h, _ in ds.mounts}
    assert {"libcuda.so.1", f"libcuda.so.{VERSION}", "libnvidia-ml.so.1"} <= names
    assert not any(n.startswith(("libz", "libnvidia-container")) for n in names)


def test_driver_version_from_proc_when_sysfs_has_none(tmp_path: Path) -> None:
    proc = tmp_path / "proc" / "driver" / "nvidia"
    proc.mkdir(parents=True)
    (proc / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.127.05  Release Build"
        "  (dvs-builder@U16-I3-B03-4-3)  Tue Oct  8 04:31:25 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert devices.driver_version(str(tmp_path / "sys"), str(tmp_path / "proc")) == VERSION
    (proc / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
    )
    assert devices.driver_version(str(tmp_path / "sys"), str(tmp_path / "proc")) == "535.183.01"
    assert devices.driver_version(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_no_gpu_no_device_set_but_a_fabric_alone_is_one(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    char_device(dev / "null")
    assert discover(str(dev), "", [], char_only=ROOT) is None
    assert devices.fabric_devices(str(dev), char_only=ROOT) is None
    char_device(dev / "infiniband" / "uverbs0")
    fabric = devices.fabric_devices(str(dev), char_only=ROOT)
    assert fabric is not None
    assert fabric.gpu_count == 0 and fabric.device_nodes == (str(dev / "infiniband" / "uverbs0"),)
    assert discover(str(dev), "", [], char_only=ROOT) is None  # GPUs decide discover()


@pytest.mark.skipif(not ROOT, reason="needs real char devices (mknod)")
def test_host_devices_prefers_nvidia_ctk_and_falls_back_to_discovery(
    host: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = str(host["dev"])
    spec = sample_spec()
    # The sample's nodes are below /dev; its host paths go below the fake dev
    # root (as a containerised driver's spec has them).
    text = re.sub(
        r'"path": "/dev/([^"]+)"', rf'"hostPath": "{dev}/\1", "path": "/dev/\1"', json.dumps(spec)
    )
    ctk = tmp_path / "nvidia-ctk"
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(text)
    ctk.write_text(f'#!/bin/sh\n[ "$*" = "cdi generate --format=json" ] && cat {spec_file}\n')
    ctk.chmod(0o755)
    found = devices.host_devices(str(ctk), dev_root=dev, ensure_uvm=False)
    assert found is not None and found.source == "cdi" and found.gpu_count == 8
    # The fabric's nodes are added to the toolkit's.
    assert str(host["dev"] / "infiniband" / "uverbs0") in found.device_nodes

    monkeypatch.setattr(devices, "_ldconfig_output", lambda: ldconfig_output(host["lib"]))
    broken = tmp_path / "broken-ctk"
    broken.write_text("#!/bin/sh\necho 'nvml error' >&2\nexit 1\n")
    broken.chmod(0o755)
    for ctk_path in (str(broken), None, "no-such-nvidia-ctk"):
        fallback = devices.host_devices(ctk_path, dev_root=dev, ensure_uvm=False)
        assert fallback is not None and fallback.source == "discovered"
        assert fallback.gpu_count == 3


def test_the_node_image_links_every_driver_tool_from_usr_local_bin() -> None:
    """scripts/build-node-image keeps its own copy of the tool list and the
    driver root (a shell script): the two must not drift apart."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "build-node-image").read_text()
    listed = re.search(r"^DRIVER_BINARIES=\(([^)]*)\)", script, re.M)
    assert listed is not None
    assert tuple(listed.group(1).split()) == devices.DRIVER_BINARIES
    assert f"\nDRIVER_ROOT={devices.DRIVER_ROOT}\n" in script


def test_relocated_paths() -> None:
    ds = DeviceSet(
        mounts=(
            ("/host/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1"),
            ("/usr/sbin/nvidia-smi", "/usr/sbin/nvidia-smi"),
            ("/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket"),
        ),
        library_dirs=("/usr/lib",),
    )
    assert ds.to_nsinit()["mounts"] == [list(m) for m in ds.mounts]  # not relocated: as they are
    moved = ds.relocated().to_nsinit()
    assert moved["mounts"] == [
        ["/host/usr/lib/libcuda.so.1", "/run/nvidia/driver/usr/lib/libcuda.so.1"],
        ["/usr/sbin/nvidia-smi", "/run/nvidia/driver/bin/nvidia-smi"],
        # The node's /run is its own: sockets stay where their clients look.
        ["/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket"],
    ]
    assert moved["library_dirs"] == ["/run/nvidia/driver/usr/lib"]
    assert moved["driver_root"] == "/run/nvidia/driver"
    for bad in ("/opt/driver", "/run/../etc"):
        with pytest.raises(ValueError, match="driver root"):
            ds.relocated(bad)
