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

Larger images (a Debian root filesystem, add-on binaries) are written by
``write_oci_archive``: one or more layers, each a gzip-compressed blob on
disk (``gzip_layer``), streamed into the archive rather than held in
memory. ``gpuclusters.imagebuild.catalog`` builds the system images that way and caches
them for a push to the cluster registry.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

BASE_IMAGE = "localhost/gpuclusters-base:latest"
PAUSE_REPO = "localhost/gpuclusters-pause"
BUSYBOX = Path("/bin/busybox")
LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"
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
    name: str,
    layers: Sequence[dict[str, Any]],
    diff_ids: Sequence[str],
    config: dict[str, Any],
    history: Sequence[str] | None = None,
) -> tuple[bytes, bytes, bytes]:
    """The config, manifest and index blobs of one image whose layers are
    described by ``layers`` (OCI descriptors) and ``diff_ids`` (the digests
    of their uncompressed tars, in the same order)."""
    if history is None:
        entries: list[dict[str, str]] = [
            {"created_by": "gpuclusters", "comment": "built locally"} for _ in layers
        ]
    else:
        entries = [{"created_by": h, "comment": "built locally"} for h in history]
    if len(entries) != len(layers) or len(diff_ids) != len(layers):
        raise ImageBuildError("one diff_id and one history entry per layer")
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
        "history": entries,
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
        "layers": list(layers),
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
    config_blob, manifest_blob, index_blob = _image_documents(name, [desc], [_sha(layer)], config)
    out = TarWriter()
    out.file("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    out.file("index.json", index_blob)
    out.dir("blobs")
    out.dir("blobs/sha256")
    for blob in (config_blob, manifest_blob, layer):
        out.file("blobs/sha256/" + _sha(blob).split(":", 1)[1], blob)
    return out.close()


# --- layers on disk -----------------------------------------------------------------------
#
# A root filesystem is hundreds of megabytes: its layer is streamed from the
# tool that makes it, through gzip, into a file, and from there into the
# archive; nothing holds it whole in memory. Layers are stored compressed so
# that the cached archive is small and a push to a registry sends the blobs
# as they are (``skopeo copy`` only compresses layers that are not).

CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class LayerBlob:
    """One layer as stored on disk: ``digest`` and ``size`` describe the file
    at ``path`` (compressed or not, per ``media_type``), ``diff_id`` the
    uncompressed tar (the image config's ``rootfs.diff_ids``)."""

    path: Path
    media_type: str
    digest: str
    size: int
    diff_id: str

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


class _Sink(Protocol):
    def write(self, data: memoryview, /) -> int: ...

    def flush(self) -> None: ...


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it on
    its way to ``sink``."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview, /) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += len(view)
        self.sink.write(view)
        return len(view)

    def flush(self) -> None:
        self.sink.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


class LayerWriter:
    """A file object that a tar stream is written to (``tarfile`` mode
    ``w|``): it hashes the uncompressed bytes (the diff_id) and writes them
    gzip-compressed to ``dest``, hashing those too (the blob digest).

    gzip's header carries no name and mtime 0, so the same tar always gives
    the same blob. Level 6, zlib's default: level 9 costs twice the time for
    about 1 % less on root filesystems."""

    def __init__(self, dest: Path, *, level: int = 6) -> None:
        self.dest = dest
        self._file = dest.open("wb")
        self._compressed = _HashingWriter(self._file)
        self._gzip = gzip.GzipFile(
            filename="", mode="wb", fileobj=self._compressed, mtime=0, compresslevel=level
        )
        self._plain = _HashingWriter(self._gzip)

    def write(self, data: bytes | memoryview, /) -> int:
        return self._plain.write(data)

    def flush(self) -> None:
        self._plain.flush()

    def close(self) -> LayerBlob:
        self._gzip.close()
        self._file.close()
        return LayerBlob(
            path=self.dest,
            media_type=LAYER_GZIP_MEDIA,
            digest=self._compressed.digest,
            size=self._compressed.size,
            diff_id=self._plain.digest,
        )

    def abort(self) -> None:
        self._file.close()
        self.dest.unlink(missing_ok=True)


def gzip_layer(chunks: Iterable[bytes], dest: Path, *, level: int = 6) -> LayerBlob:
    """Write an uncompressed layer tar, given as chunks, to ``dest`` as a
    gzip-compressed blob."""
    writer = LayerWriter(dest, level=level)
    try:
        for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def write_oci_archive(
    dest: Path,
    name: str,
    layers: Sequence[LayerBlob],
    config: dict[str, Any],
    *,
    history: Sequence[str] | None = None,
) -> str:
    """Write one image, its layers in order (the first at the bottom), as
    an OCI image-layout tar at ``dest``; returns the manifest digest.

    Written beside ``dest`` and renamed into place, so a reader never sees a
    half archive. The same layers and config give the same bytes (fixed
    mtimes, owners and order), like ``oci_archive``."""
    if not layers:
        raise ImageBuildError(f"{name}: an image needs at least one layer")
    config_blob, manifest_blob, index_blob = _image_documents(
        name,
        [layer.descriptor() for layer in layers],
        [la.diff_id for la in layers],
        config,
        history,
    )
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with (
            tmp.open("wb") as f,
            tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):

            def small(path: str, data: bytes) -> None:
                info = _tarinfo(path, tarfile.REGTYPE, 0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            small("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            small("index.json", index_blob)
            tar.addfile(_tarinfo("blobs", tarfile.DIRTYPE, 0o755))
            tar.addfile(_tarinfo("blobs/sha256", tarfile.DIRTYPE, 0o755))
            small("blobs/sha256/" + _sha(config_blob).split(":", 1)[1], config_blob)
            small("blobs/sha256/" + _sha(manifest_blob).split(":", 1)[1], manifest_blob)
            seen: set[str] = set()
            for layer in layers:
                if layer.digest in seen:  # the same layer twice is one blob
                    continue
                seen.add(layer.digest)
                info = _tarinfo(
                    "blobs/sha256/" + layer.digest.split(":", 1)[1], tarfile.REGTYPE, 0o644
                )
                info.size = layer.size
                if layer.path.stat().st_size != layer.size:
                    raise ImageBuildError(f"{layer.path} changed since it was written")
                with layer.path.open("rb") as blob:
                    tar.addfile(info, blob)
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _sha(manifest_blob)


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
