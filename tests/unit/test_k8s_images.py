"""Locally built container images (layers/kubernetes/images): the OCI
image-layout archive is self-consistent (every blob named by its digest, the
index, manifest and config reference each other), deterministic, and the
base and pause layers hold what a node expects."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.images import (
    BUSYBOX,
    CONFIG_MEDIA,
    LAYER_MEDIA,
    MANIFEST_MEDIA,
    Image,
    ImageBuildError,
    oci_archive,
)

needs_busybox = pytest.mark.skipif(not BUSYBOX.is_file(), reason=f"{BUSYBOX} is missing")


def _layer(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


LAYER = _layer({"hello.txt": b"hello\n"})
CONFIG: dict[str, Any] = {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]}


def _files(archive: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                out[member.name] = f.read()
    return out


def _members(archive: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: m for m in tar.getmembers()}


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(files: dict[str, bytes], digest: str) -> bytes:
    algo, hexdigest = digest.split(":", 1)
    assert algo == "sha256"
    return files[f"blobs/sha256/{hexdigest}"]


def test_oci_archive_layout_and_annotations() -> None:
    name = "localhost/gpuclusters-demo:v1.2"
    files = _files(oci_archive(name, LAYER, CONFIG))
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    [desc] = index["manifests"]
    assert desc["mediaType"] == MANIFEST_MEDIA
    assert desc["annotations"] == {
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": "v1.2",
    }
    manifest_blob = _blob(files, desc["digest"])
    assert desc["size"] == len(manifest_blob)
    assert json.loads(manifest_blob)["mediaType"] == MANIFEST_MEDIA


def test_oci_archive_blobs_are_content_addressed_and_linked() -> None:
    files = _files(oci_archive("localhost/demo:latest", LAYER, CONFIG))
    blobs = {n: d for n, d in files.items() if n.startswith("blobs/sha256/")}
    assert len(blobs) == 3  # config, manifest, layer
    for path, data in blobs.items():
        assert hashlib.sha256(data).hexdigest() == path.rsplit("/", 1)[1]

    [desc] = json.loads(files["index.json"])["manifests"]
    manifest = json.loads(_blob(files, desc["digest"]))
    assert manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == CONFIG_MEDIA
    [layer_desc] = manifest["layers"]
    assert layer_desc == {"mediaType": LAYER_MEDIA, "digest": _sha(LAYER), "size": len(LAYER)}
    assert _blob(files, layer_desc["digest"]) == LAYER

    config_blob = _blob(files, manifest["config"]["digest"])
    assert manifest["config"]["size"] == len(config_blob)
    config = json.loads(config_blob)
    assert config["rootfs"] == {"type": "layers", "diff_ids": [_sha(LAYER)]}
    assert config["config"] == CONFIG
    assert (config["os"], config["architecture"]) == ("linux", "amd64")


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("localhost/base:latest", "latest"),
        ("localhost/base:1.34.4", "1.34.4"),
        ("localhost/base", "latest"),
        # A registry port is not a tag.
        ("localhost:5000/base", "latest"),
        ("localhost:5000/base:v2", "v2"),
    ],
)
def test_oci_archive_ref_name_tag(name: str, tag: str) -> None:
    files = _files(oci_archive(name, LAYER, CONFIG))
    [desc] = json.loads(files["index.json"])["manifests"]
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == tag
    assert desc["annotations"]["io.containerd.image.name"] == name


def test_oci_archive_is_deterministic() -> None:
    first = oci_archive("localhost/demo:latest", LAYER, CONFIG)
    second = oci_archive("localhost/demo:latest", LAYER, dict(CONFIG))
    assert first == second
    # Entries are root-owned with mtime 0, whatever the clock or user.
    for member in _members(first).values():
        assert (member.uid, member.gid, member.mtime) == (0, 0, 0)
    # A different layer gives a different archive.
    assert oci_archive("localhost/demo:latest", _layer({"x": b"y"}), CONFIG) != first


@needs_busybox
def test_base_layer_has_busybox_applets_and_sticky_tmp() -> None:
    layer = images.base_layer()
    members = _members(layer)
    busybox = members["bin/busybox"]
    assert busybox.isfile()
    assert busybox.size == BUSYBOX.stat().st_size
    assert stat.S_IMODE(busybox.mode) == 0o755
    sh = members["bin/sh"]
    assert sh.issym()
    assert sh.linkname == "busybox"
    tmp = members["tmp"]
    assert tmp.isdir()
    assert stat.S_IMODE(tmp.mode) == 0o1777
    assert stat.S_IMODE(members["root"].mode) == 0o700
    files = _files(layer)
    assert files["etc/passwd"].startswith(b"root:x:0:0:")
    # Deterministic too.
    assert images.base_layer() == layer


@needs_busybox
def test_base_image_is_importable_under_its_name() -> None:
    image = images.base_image()
    assert image.name == images.BASE_IMAGE
    [desc] = json.loads(_files(image.archive)["index.json"])["manifests"]
    assert desc["annotations"]["io.containerd.image.name"] == images.BASE_IMAGE


def test_pause_layer_and_image(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF not really")
    layer = images.pause_layer(binary)
    member = _members(layer)["pause"]
    assert stat.S_IMODE(member.mode) == 0o755
    assert _files(layer)["pause"] == b"\x7fELF not really"

    image = images.pause_image(binary, "v9.9.9")
    assert image.name == images.pause_image_name("v9.9.9") == f"{images.PAUSE_REPO}:v9.9.9"
    files = _files(image.archive)
    [desc] = json.loads(files["index.json"])["manifests"]
    manifest = json.loads(_blob(files, desc["digest"]))
    assert _blob(files, manifest["layers"][0]["digest"]) == layer
    config = json.loads(_blob(files, manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/pause"]


def test_missing_inputs_raise_image_build_error(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError):
        images.pause_layer(tmp_path / "no-pause")
    with pytest.raises(ImageBuildError):
        images.base_layer(tmp_path / "no-busybox")
    # A directory is not a binary either.
    with pytest.raises(ImageBuildError):
        images.pause_layer(tmp_path)


def test_unrunnable_busybox_raises_image_build_error(tmp_path: Path) -> None:
    fake = tmp_path / "busybox"
    fake.write_bytes(b"not a program\n")
    fake.chmod(0o644)  # not executable: listing its applets fails
    with pytest.raises(ImageBuildError):
        images.base_layer(fake)


def test_image_file_name_is_a_plain_file_name() -> None:
    image = Image("localhost:5000/gpuclusters-pause:1.34.4", b"")
    assert "/" not in image.file_name
    assert ":" not in image.file_name
    assert image.file_name.endswith(".tar")
    assert Image("localhost/a:b", b"").file_name != Image("localhost/a:c", b"").file_name
