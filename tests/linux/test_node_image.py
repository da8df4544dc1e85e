"""Nodes that boot from the node image (``scripts/build-node-image``,
``GPUCLUSTERS_NODE_IMAGE``): a node's /usr, /opt... are the image's, its
/etc is over the image's, and a file the host has in its own directories is
not in the node, while a node booted without the image does see it (so the
test fails where the image is not used).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodetools import Fleet

from gpuclusters.core import idblocks
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.linux import nodeimage
from gpuclusters.linux.devices import DRIVER_ROOT, DeviceSet
from gpuclusters.providers.base import PermanentProviderError
from gpuclusters.server.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-node-image"


@pytest.fixture(scope="module")
def image() -> Path:
    """The cached node image, built by the script if this machine lacks it."""
    proc = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"scripts/build-node-image failed:\n{proc.stderr}"
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def host_marker() -> Iterator[tuple[Path, str]]:
    """A file only the host has, in a directory nodes used to share (/opt)."""
    name = f"gpct-host-only-{secrets.token_hex(4)}"
    path = Path("/opt") / name
    path.write_text("host\n")
    try:
        yield path, "host"
    finally:
        path.unlink(missing_ok=True)


async def _sees(shell: NodeShell, path: Path) -> bool:
    return (await shell.run(["test", "-e", str(path)], check=False)).returncode == 0


async def test_a_node_sees_its_image_not_the_host(
    fleet: Fleet, image: Path, host_marker: tuple[Path, str]
) -> None:
    marker, _ = host_marker
    cluster = fleet.cluster()
    plain = fleet.provider()
    spec = fleet.spec(cluster, "img-plain", "h100-a-01")
    await plain.create(spec)
    # Without the image the host's /opt is the node's: the check below can fail.
    assert await _sees(await plain.shell(spec.node_id), marker)

    p = fleet.provider(image=image, userns=True)
    ids = idblocks.block(7)
    spec = fleet.spec(cluster, "img-node", "h100-a-02", host_ids=ids)
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    assert not await _sees(sh, marker)
    # The image's own marker file, in the node's /etc (over the image's).
    listed = await sh.run(["cat", "/etc/gpuclusters-node-packages"])
    assert "slurmd" in listed.stdout.split()
    # Its /usr is the image's: the same inode as the image's, not the host's.
    node_usr = (await sh.run(["stat", "-L", "-c", "%i", "/usr/bin/python3"])).stdout.strip()
    assert node_usr == str(os.stat(image / "usr/bin/python3").st_ino)
    # The image's accounts (munge's uid as the image's build gave it).
    image_munge = next(
        line.split(":")[2]
        for line in (image / "etc/passwd").read_text().splitlines()
        if line.startswith("munge:")
    )
    assert (await sh.run(["id", "-u", "munge"])).stdout.strip() == image_munge
    # What nodes run works from the image (and the node's root is nobody).
    for argv in (["python3", "-c", "print(6 * 7)"], ["slurmd", "-V"], ["munged", "-V"],
                 ["containerd", "--version"], ["runc", "--version"]):  # fmt: skip
        r = await sh.run(argv, check=False)
        assert r.returncode == 0, f"{argv}: {r.stderr}"
    assert (await sh.run(["cat", "/proc/self/uid_map"])).stdout.split()[:2] == ["0", str(ids.first)]
    # Nothing of the image is writable from the node, root included.
    r = await sh.run(["touch", "/usr/bin/gpct-write"], check=False)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    # The secrets the packages generate are not in the image.
    for secret in ("etc/munge/munge.key", "etc/mysql/debian.cnf"):
        assert not (image / secret).exists()


async def test_a_share_inside_an_image_directory_gets_its_mount_point(
    fleet: Fleet, image: Path
) -> None:
    """A host agent's virtual environment is /opt/gpuclusters/venv, inside
    the image's /opt, which has no such directory and is read-only: the
    node's /opt is then its own, with the image's entries bound in it."""
    assert (image / "opt").is_dir() and not (image / "opt/gpct-share").exists()
    share = Path("/opt/gpct-share") / secrets.token_hex(4)
    share.mkdir(parents=True)
    try:
        (share / "marker").write_text("shared\n")
        p = fleet.provider(image=image, userns=True, extra_shares=(share,))
        spec = fleet.spec(fleet.cluster(), "img-share", "h100-a-01", host_ids=idblocks.block(10))
        await p.create(spec)
        sh = await p.shell(spec.node_id)
        assert (await sh.run(["cat", str(share / "marker")])).stdout == "shared\n"
        r = await sh.run(["touch", str(share / "x")], check=False)
        assert r.returncode != 0 and "Read-only file system" in r.stderr
        # The rest of the node's /opt is the image's: nothing else of the host's.
        listed = (await sh.run(["ls", "-A", "/opt"])).stdout.split()
        assert listed == sorted({*os.listdir(image / "opt"), "gpct-share"})
    finally:
        shutil.rmtree("/opt/gpct-share")


async def test_a_munge_and_slurm_daemon_run_from_the_image(fleet: Fleet, image: Path) -> None:
    """munged with the node's own key, as the image's munge account; a
    credential made and decoded: the daemons the Slurm layer starts work
    with the image's files and accounts."""
    p = fleet.provider(image=image, userns=True)
    spec = fleet.spec(fleet.cluster(), "img-munge", "h100-a-01", host_ids=idblocks.block(8))
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    script = (
        "set -e; install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge; "
        "install -d -o munge -g munge -m 0755 /run/munge; "
        "head -c 128 /dev/urandom > /etc/munge/munge.key; "
        "chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; "
        "setpriv --reuid=munge --regid=munge --init-groups munged; "
        "munge -n | unmunge | grep -q 'STATUS: *Success'"
    )
    r = await sh.run(["sh", "-c", script], check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def _fake_driver(hw: Path) -> DeviceSet:
    """A host's GPU driver as linux/devices.py finds it: a GPU and its
    control node (char devices with /dev/null's numbers), a real shared
    object named and sonamed as the driver's libraries are, and a tool."""
    dev = hw / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidiactl"):
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    src = hw / "gpct.c"
    src.write_text("int gpct_driver(void) { return 42; }\n")
    lib = hw / "libnvidia-gpct.so.550.54.15"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-gpct.so.1", "-o", str(lib), str(src)],
        check=True,
    )
    tool = hw / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho fake nvidia-smi\n")
    tool.chmod(0o755)
    return DeviceSet(
        device_nodes=(str(dev / "nvidia0"), str(dev / "nvidiactl")),
        mounts=((str(lib), DRIVER_LIB), (str(tool), "/usr/bin/nvidia-smi")),
        gpu_count=1,
        dev_root=str(dev),
        library_dirs=(os.path.dirname(DRIVER_LIB),),
    )


DRIVER_LIB = "/usr/lib/x86_64-linux-gnu/libnvidia-gpct.so.550.54.15"
LOAD = "import ctypes; print(ctypes.CDLL('libnvidia-gpct.so.1').gpct_driver())"


async def test_the_gpu_driver_reaches_a_node_on_the_image(
    fleet: Fleet, image: Path, tmp_path: Path
) -> None:
    """The image's /usr is read-only and has no driver: the host's driver
    files go below the node's driver root, the loader finds the libraries
    (ldconfig with the relocated folder) and the tools are on PATH."""
    devices = _fake_driver(tmp_path / "hw")
    cluster = fleet.cluster()
    # Without the image, the driver's files are only where the node shares the
    # host's /usr: one the host lacks there cannot be placed, and no program in
    # the node loads it (the check below can fail).
    plain = fleet.provider(devices=devices)
    spec = fleet.spec(cluster, "drv-plain", "h100-a-01")
    await plain.create(spec)
    sh = await plain.shell(spec.node_id)
    report = (await sh.run(["cat", "/run/gpuclusters/devices"])).stdout
    assert f"skipped {DRIVER_LIB}" in report
    r = await sh.run([sys.executable, "-c", LOAD], check=False)
    assert r.returncode != 0 and "libnvidia-gpct.so.1" in r.stderr

    p = fleet.provider(image=image, userns=True, devices=devices)
    spec = fleet.spec(cluster, "drv-image", "h100-a-02", host_ids=idblocks.block(9))
    await p.create(spec)
    sh = await p.shell(spec.node_id)
    report = (await sh.run(["cat", "/run/gpuclusters/devices"])).stdout.splitlines()
    assert f"bound {DRIVER_ROOT}{DRIVER_LIB}" in report
    assert f"bound {DRIVER_ROOT}/bin/nvidia-smi" in report
    assert f"ldconfig {DRIVER_ROOT}/usr/lib/x86_64-linux-gnu" in report
    # The image's /usr itself is untouched.
    assert not await _sees(sh, Path(DRIVER_LIB))
    r = await sh.run(["python3", "-c", LOAD], check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "42"), r.stderr
    # The soname link, made by the node's own ldconfig beside the bound file.
    link = await sh.run(["readlink", f"{DRIVER_ROOT}/usr/lib/x86_64-linux-gnu/libnvidia-gpct.so.1"])
    assert link.stdout.strip() == "libnvidia-gpct.so.550.54.15"
    smi = await sh.run(["sh", "-c", "command -v nvidia-smi && nvidia-smi"], check=False)
    assert smi.stdout.split() == ["/usr/local/bin/nvidia-smi", "fake", "nvidia-smi"], smi.stderr
    # The driver's files are read-only to the node's root.
    r = await sh.run(["sh", "-c", f"echo x >> {DRIVER_ROOT}{DRIVER_LIB}"], check=False)
    assert r.returncode != 0
    # The node's device plugin hands containers the host's paths.
    info = json.loads((await sh.run(["cat", "/etc/gpuclusters/node.json"])).stdout)
    assert [m[2] for m in info["devices"]["mounts"]] == [DRIVER_LIB, "/usr/bin/nvidia-smi"]


def test_a_directory_that_is_not_an_image_is_refused(tmp_path: Path) -> None:
    with pytest.raises(nodeimage.NodeImageError, match="usr/bin/python3"):
        nodeimage.check(tmp_path)
    env = {"GPUCLUSTERS_HOME": str(tmp_path / "home"), "GPUCLUSTERS_NODE_IMAGE": str(tmp_path)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(ValueError, match="node_image"):
            Settings()


def test_host_paths_are_never_shared_over_the_image() -> None:
    assert nodeimage.hidden_by_image(Path("/usr"))
    assert nodeimage.hidden_by_image(Path("/usr/lib/python3.11"))
    assert not nodeimage.hidden_by_image(Path("/root/.pyenv/versions/3.11.7"))
    assert not nodeimage.hidden_by_image(Path("/usrx"))


def test_the_newest_complete_image_is_the_default(tmp_path: Path) -> None:
    assert nodeimage.newest_built(tmp_path) is None
    for key, stamp_time in (("old", 1000), ("new", 2000), ("half", None)):
        (tmp_path / key / "rootfs").mkdir(parents=True)
        if stamp_time is not None:
            stamp = tmp_path / key / ".complete"
            stamp.touch()
            os.utime(stamp, (stamp_time, stamp_time))
    assert nodeimage.newest_built(tmp_path) == tmp_path / "new" / "rootfs"
    # A build still in progress (no stamp) is never taken.
    os.utime(tmp_path / "new" / ".complete", (500, 500))
    assert nodeimage.newest_built(tmp_path) == tmp_path / "old" / "rootfs"


@pytest.fixture
def overlay_image(image: Path, tmp_path: Path) -> Iterator[Path]:
    """The node image seen through an overlayfs, as on a host whose root is
    one (a container's): a file system that refuses idmapped mounts."""
    upper, work, merged = tmp_path / "upper", tmp_path / "work", tmp_path / "merged"
    for d in (upper, work, merged):
        d.mkdir()
    opts = f"lowerdir={image},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], check=True)
    try:
        yield merged
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=True)


async def test_user_namespace_nodes_are_refused_where_nothing_can_be_idmapped(
    fleet: Fleet, overlay_image: Path
) -> None:
    p = fleet.provider(image=overlay_image, userns=True)
    cluster = fleet.cluster()
    spec = fleet.spec(cluster, "ov-user", "h100-a-01", host_ids=idblocks.block(9))
    with pytest.raises(PermanentProviderError, match="cannot run nodes in user namespaces"):
        await p.create(spec)
    assert spec.node_id not in fleet.recorded_ids()  # nothing half made
    # The same image and host without a user namespace: the refusal is the
    # idmapping's, not the image's.
    plain = fleet.spec(cluster, "ov-plain", "h100-a-02")
    await p.create(plain)
    r = await (await p.shell(plain.node_id)).run(["python3", "-c", "print(1)"])
    assert r.stdout.strip() == "1"


def test_none_boots_nodes_from_the_host(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUCLUSTERS_HOME", str(tmp_path / "home"))
        mp.setenv("GPUCLUSTERS_NODE_IMAGE", "none")
        assert Settings().node_image is None
