"""Container images built locally, from files already on the machine.

The embedded fleet reaches no registry, so the two images every Kubernetes
node needs are assembled here as OCI image-layout archives and imported into
each node's containerd (``ctr images import``):

* ``localhost/gpuclusters-pause:<k8s version>``: the pod sandbox, running
  the ``pause`` binary compiled from the pinned Kubernetes release's own
  ``build/pause/linux/pause.c`` (``scripts/build-k8s``);
* ``localhost/gpuclusters-base:latest``: a small image with a shell and the
  usual tools, the host's statically linked ``busybox`` and its applets.

Archives are deterministic (fixed mtimes, owners and order), so the same
inputs give the same digests on every node and every run; writing one to a
node that has it is a no-op.

In production, nodes pull from a real registry: the pause image comes from
``registry.k8s.io/pause`` (containerd's ``sandbox_image``) and users push
their own images; nothing here is needed there.

The system images clusters pull from the registry (a Debian root
filesystem, add-on binaries) are a build tool's business:
``gpuclusters.imagebuild`` makes them with umoci, reusing ``base_layer`` and
``pause_layer`` from here.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

BASE_IMAGE = "localhost/gpuclusters-base:latest"
PAUSE_REPO = "localhost/gpuclusters-pause"
BUSYBOX = Path("/bin/busybox")
LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Image:
    name: str  # full reference, e.g. localhost/gpuclusters-base:latest
    archive: bytes  # OCI image layout, as a tar

    @property
    def file_name(self) -> str:
        return self.name.replace("/", "_").replace(":", "_") + ".tar"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tarinfo(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    """A tar entry with nothing of the build machine in it: mtime 0, numeric
    owners (root by default)."""
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, 0
    info.uid, info.gid = uid, gid
    # Names only for root: an image's own /etc/passwd decides the others.
    info.uname = "root" if uid == 0 else ""
    info.gname = "root" if gid == 0 else ""
    return info


class TarWriter:
    """A deterministic tar writer: root-owned entries, mtime 0, in call order."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        # Closed in close(); a context manager cannot span the builder's calls.
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115

    def dir(self, name: str, mode: int = 0o755, *, uid: int = 0, gid: int = 0) -> None:
        self.tar.addfile(_tarinfo(name, tarfile.DIRTYPE, mode, uid, gid))

    def file(
        self, name: str, data: bytes, mode: int = 0o644, *, uid: int = 0, gid: int = 0
    ) -> None:
        info = _tarinfo(name, tarfile.REGTYPE, mode, uid, gid)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        info = _tarinfo(name, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self.tar.addfile(info)

    def close(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def _image_documents(
    name: str, layer: dict[str, Any], diff_id: str, config: dict[str, Any]
) -> tuple[bytes, bytes, bytes]:
    """The config, manifest and index blobs of one single-layer image whose
    layer is described by ``layer`` (an OCI descriptor) and ``diff_id`` (the
    digest of its uncompressed tar)."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "gpuclusters", "comment": "built locally"}],
    }
    config_blob = json.dumps(image_config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {
            "mediaType": CONFIG_MEDIA,
            "digest": _sha(config_blob),
            "size": len(config_blob),
        },
        "layers": [layer],
    }
    manifest_blob = json.dumps(manifest, sort_keys=True).encode()
    # A colon after the last slash starts a tag; one before it is a port.
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA,
        "manifests": [
            {
                "mediaType": MANIFEST_MEDIA,
                "digest": _sha(manifest_blob),
                "size": len(manifest_blob),
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    return config_blob, manifest_blob, json.dumps(index, sort_keys=True).encode()


def oci_archive(name: str, layer: bytes, config: dict[str, Any]) -> bytes:
    """One single-layer image as an OCI image-layout tar that containerd
    imports under ``name``."""
    desc = {"mediaType": LAYER_MEDIA, "digest": _sha(layer), "size": len(layer)}
    config_blob, manifest_blob, index_blob = _image_documents(name, desc, _sha(layer), config)
    out = TarWriter()
    out.file("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    out.file("index.json", index_blob)
    out.dir("blobs")
    out.dir("blobs/sha256")
    for blob in (config_blob, manifest_blob, layer):
        out.file("blobs/sha256/" + _sha(blob).split(":", 1)[1], blob)
    return out.close()


def _applets(busybox: Path) -> list[str]:
    try:
        listed = subprocess.run(
            [str(busybox), "--list"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise ImageBuildError(f"cannot list the applets of {busybox}: {exc}") from exc
    return sorted(a for a in listed if a and "/" not in a and a != "busybox")


def base_layer(busybox: Path = BUSYBOX) -> bytes:
    if not busybox.is_file():
        raise ImageBuildError(f"{busybox} is missing: install Debian's busybox-static")
    t = TarWriter()
    for d in ("bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "var", "mnt"):
        t.dir(d, 0o700 if d == "root" else 0o755)
    t.dir("tmp", 0o1777)
    t.file("bin/busybox", busybox.read_bytes(), 0o755)
    for applet in _applets(busybox):
        t.symlink(f"bin/{applet}", "busybox")
    t.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    t.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    return t.close()


def pause_layer(pause_binary: Path) -> bytes:
    if not pause_binary.is_file():
        raise ImageBuildError(f"{pause_binary} is missing: run scripts/build-k8s")
    t = TarWriter()
    t.file("pause", pause_binary.read_bytes(), 0o755)
    return t.close()


@cache
def base_image(busybox: Path = BUSYBOX) -> Image:
    config = {"Env": [PATH_ENV], "Cmd": ["/bin/sh"], "WorkingDir": "/"}
    return Image(BASE_IMAGE, oci_archive(BASE_IMAGE, base_layer(busybox), config))


def pause_image_name(k8s_version: str) -> str:
    return f"{PAUSE_REPO}:{k8s_version}"


@cache
def pause_image(pause_binary: Path, k8s_version: str) -> Image:
    name = pause_image_name(k8s_version)
    config = {"Entrypoint": ["/pause"], "User": "65535:65535"}
    return Image(name, oci_archive(name, pause_layer(pause_binary), config))
