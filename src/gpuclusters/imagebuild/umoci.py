"""OCI image layouts assembled by umoci (Debian's ``umoci`` package), packed
as the OCI archives that ``skopeo copy oci-archive:FILE`` pushes.

The image builder makes layer *contents* (a Debian root filesystem, a few
files, a static binary) as plain tar streams; everything about the image
format is umoci's: it compresses each layer (gzip), computes the blob
digests and diff IDs, writes the image config, the manifest and the index,
and drops unreferenced blobs (``umoci gc``). Our part is the order of calls
and fixed times, so that the same layers and config give the same archive:

1. ``umoci init --layout DIR`` and ``umoci new --image DIR:TAG``;
2. per layer, bottom first, ``umoci raw add-layer ... /dev/stdin``: the
   layer's tar is streamed into umoci, never written to disk uncompressed;
   its history entry gets ``CREATED`` and the layer's description;
3. ``umoci config --no-history --created CREATED ...`` for the entrypoint,
   command, environment, user and working directory;
4. ``umoci gc``, then GNU tar packs ``oci-layout``, ``index.json`` and
   ``blobs/`` with sorted names, mtime 0 and root ownership, into a file
   beside the archive that is renamed into place (a reader never sees half
   an archive).

The index names the image by its tag (``org.opencontainers.image.ref.name``),
which is what skopeo reads from a one-image archive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpuclusters.layers.kubernetes.images import ImageBuildError

# Every history entry and the image itself: SOURCE_DATE_EPOCH's day, so that
# a rebuild from the same inputs gives the same digests.
CREATED = "2024-01-01T00:00:00Z"
HISTORY_COMMENT = "built locally"
ARCHITECTURE = "amd64"


class UmociMissingError(ImageBuildError):
    """umoci is not installed."""


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """The runtime part of an image's config (an empty field is left
    unset: no ``User`` runs as root, as in an image without USER)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    user: str = ""
    workdir: str = ""

    def arguments(self) -> list[str]:
        args = [f"--config.env={e}" for e in self.env]
        args += [f"--config.entrypoint={a}" for a in self.entrypoint]
        args += [f"--config.cmd={a}" for a in self.cmd]
        if self.user:
            args.append(f"--config.user={self.user}")
        if self.workdir:
            args.append(f"--config.workingdir={self.workdir}")
        return args


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One layer of a packed image: its compressed blob (``digest``,
    ``size``) and its uncompressed tar (``diff_id``)."""

    digest: str
    diff_id: str
    size: int


@dataclass(frozen=True, slots=True)
class Packed:
    manifest_digest: str
    layers: tuple[LayerInfo, ...]


# Writes one layer's uncompressed tar to the stream it is given.
TarSource = Callable[[IO[bytes]], None]


def umoci_binary() -> str:
    path = shutil.which("umoci")
    if path is None:
        raise UmociMissingError("umoci is not installed (apt-get install umoci)")
    return path


class Layout:
    """One image being assembled in the OCI layout directory ``path``
    (created here; it must not exist) under ``tag``."""

    def __init__(self, path: Path, tag: str) -> None:
        self.path = path
        self.tag = tag
        self._umoci = umoci_binary()
        self._run("init", "--layout", str(path))
        self._run("new", "--image", self.image)

    @property
    def image(self) -> str:
        return f"{self.path}:{self.tag}"

    def _run(self, *args: str) -> None:
        r = subprocess.run(
            [self._umoci, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        if r.returncode != 0:
            raise ImageBuildError(f"umoci {args[0]} failed: {r.stderr.strip() or r.stdout.strip()}")

    def add_layer(self, write: TarSource, history: str) -> None:
        """Append a layer on top: ``write`` streams its plain tar into umoci."""
        # umoci's messages go to a file: a pipe nobody reads while the layer
        # streams could fill up and stall it.
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(
                [
                    self._umoci, "raw", "add-layer", "--image", self.image,
                    f"--history.created_by={history}",
                    f"--history.created={CREATED}",
                    f"--history.comment={HISTORY_COMMENT}",
                    "/dev/stdin",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=errors,
            )  # fmt: skip
            assert proc.stdin is not None
            broken = False
            try:
                try:
                    write(proc.stdin)
                except BrokenPipeError:
                    broken = True  # umoci stopped reading: its exit says why
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()
        if rc != 0 or broken:
            raise ImageBuildError(f"umoci raw add-layer failed (exit {rc}): {message}")

    def configure(self, config: ImageConfig) -> None:
        self._run(
            "config", "--image", self.image, "--no-history",
            f"--created={CREATED}", f"--architecture={ARCHITECTURE}", "--os=linux",
            *config.arguments(),
        )  # fmt: skip

    def pack(self, dest: Path) -> Packed:
        """Drop unreferenced blobs and write the layout as an OCI archive at
        ``dest``; returns the manifest digest and the layers."""
        self._run("gc", "--layout", str(self.path))
        packed = self.describe()
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            r = subprocess.run(
                [
                    "tar", "--create", "--file", str(tmp), "--directory", str(self.path),
                    "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
                    "--format=gnu",
                    "oci-layout", "index.json", "blobs",
                ],
                capture_output=True,
                text=True,
            )  # fmt: skip
            if r.returncode != 0:
                raise ImageBuildError(f"packing {dest.name} failed: {r.stderr.strip()}")
            tmp.replace(dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return packed

    def _blob(self, digest: str) -> Any:
        algorithm, _, hexdigest = digest.partition(":")
        return json.loads((self.path / "blobs" / algorithm / hexdigest).read_bytes())

    def describe(self) -> Packed:
        """The image's manifest digest and layers, read back from the layout."""
        index = json.loads((self.path / "index.json").read_bytes())
        tagged = [
            m
            for m in index.get("manifests", [])
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == self.tag
        ]
        if len(tagged) != 1:
            raise ImageBuildError(f"{self.path}: {len(tagged)} manifests tagged {self.tag!r}")
        manifest = self._blob(tagged[0]["digest"])
        config = self._blob(manifest["config"]["digest"])
        diff_ids: Sequence[str] = config["rootfs"]["diff_ids"]
        if len(diff_ids) != len(manifest["layers"]):
            raise ImageBuildError(f"{self.path}: the config and manifest disagree on layers")
        layers = tuple(
            LayerInfo(digest=layer["digest"], diff_id=diff_id, size=layer["size"])
            for layer, diff_id in zip(manifest["layers"], diff_ids, strict=True)
        )
        return Packed(manifest_digest=tagged[0]["digest"], layers=layers)


def build_archive(
    dest: Path,
    tag: str,
    layers: Sequence[tuple[TarSource, str]],
    config: ImageConfig,
    work: Path,
) -> Packed:
    """Assemble one image from ``layers`` (each a tar source and its history
    line, bottom first) in a layout under ``work`` and pack it at ``dest``."""
    if not layers:
        raise ImageBuildError(f"{dest.name}: an image needs at least one layer")
    layout = Layout(work / "layout", tag)
    for write, history in layers:
        layout.add_layer(write, history)
    layout.configure(config)
    return layout.pack(dest)
