"""The system images every cluster can run, built on this machine without
Docker and cached as OCI image-layout archives for a push to the cluster
registry (``skopeo copy oci-archive:FILE docker://REGISTRY/<ref>``).

Why build at all: this machine reaches package registries (the Go module
proxy, Debian's mirrors) but no container registry, so the add-ons' released
images cannot be pulled. Each image is put together from what *can* be had
here instead, and matches the upstream image where the upstream manifests
rely on it (the binary's path, the entrypoint, the default user), because
those manifests are installed unchanged but for their image references.

A recipe (``ImageRecipe``) is a list of layers plus the image config. The
recipes make only the layers' contents, each a plain tar stream; umoci
assembles the image around them (``imagebuild/umoci.py``: compression,
digests, the config, manifest and index). Three kinds of layer:

* ``FilesLayer``: files of this machine (a Go binary built by
  ``scripts/build-k8s-addons``, the CA bundle) and inline files, written by
  our own deterministic tar writer; a static binary's image is that one
  layer, like a distroless image (``static_image``);
* ``DebianLayer``: a Debian root filesystem made by ``mmdebstrap`` (root
  mode) with the recipe's packages, hooks and files, slimmed (no docs, man
  pages or locales; no package lists) and streamed as a tar into umoci
  (``debian_image``);
* ``BuiltLayer``: a layer from one of ``images``' builders, so the pause and
  base images here hold the very layers the nodes import.

Adding an image is one entry in ``default_recipes``: ``debian_image(name,
tag, packages, files=..., hooks=...)`` or ``static_image(...)``.

Caching: ``<cache>/<name>_<tag>.tar`` and beside it a stamp
``.<name>_<tag>.json`` with the hash of the recipe's inputs (each file's
sha256, the package list, hooks, the image config, ``RECIPE_VERSION``). A
build skips an image whose stamp matches; a changed binary or package list
rebuilds it. The Debian mirror's content is not an input: ``--force``
rebuilds with today's packages (security updates). The cache directory is
``/var/cache/gpuclusters/images`` or ``$GPUCLUSTERS_IMAGES_CACHE``.

Command line::

    python -m gpuclusters.imagebuild.catalog build [NAME...] [--force]
    python -m gpuclusters.imagebuild.catalog list [--output json]
    python -m gpuclusters.imagebuild.catalog check [NAME...]

``scripts/build-images`` wraps ``build`` for ``scripts/setup``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, cast

from gpuclusters.imagebuild import umoci
from gpuclusters.layers.kubernetes import config as k8s_config
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.images import PATH_ENV, ImageBuildError, TarWriter

# Bump when a builder changes what it writes for the same inputs: every
# image is rebuilt once.
RECIPE_VERSION = 2

REPOSITORY_PREFIX = "gpuclusters.io"
CACHE_ENV = "GPUCLUSTERS_IMAGES_CACHE"
DEFAULT_CACHE = Path("/var/cache/gpuclusters/images")

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR_ENV = "GPUCLUSTERS_IMAGES_DEBIAN_MIRROR"
DEBIAN_SECURITY_MIRROR_ENV = "GPUCLUSTERS_IMAGES_DEBIAN_SECURITY_MIRROR"
# Files in the root filesystems get at most this mtime (mmdebstrap clamps to
# $SOURCE_DATE_EPOCH), so the same packages give the same layer, unless a
# package makes random files (the MPI image's SSH host keys). Python's
# bytecode stays valid: with SOURCE_DATE_EPOCH set, the .pyc files compiled at
# install time are hash-checked, not timestamp-checked (py_compile's default).
SOURCE_DATE_EPOCH = 1704067200  # 2024-01-01T00:00:00Z

KUEUE_VERSION = "v0.17.0"
MPI_OPERATOR_VERSION = "v0.8.0"
VOLCANO_VERSION = "v1.14.1"
# SkyPilot's pod runtime: the laptops' SkyPilot release (the newest on PyPI)
# and the Ray its sky/skylet/constants.py pins; docs/ecosystem/skypilot.md.
SKYPILOT_VERSION = "0.14.1"
SKYPILOT_RUNTIME = (
    f"skypilot[kubernetes,remote]=={SKYPILOT_VERSION}",
    "ray[default]==2.9.3",
    "pydantic-core==2.41.1",
    "click<8.3.0",
    "setuptools<70",
)


def say(message: str) -> None:
    print(f"image_catalog: {message}", file=sys.stderr, flush=True)


class MissingInputError(ImageBuildError):
    """An input of a recipe is not on this machine (yet)."""


# --- inputs -----------------------------------------------------------------------------------

_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for this
    process: ``list`` and ``build`` hash the same binaries."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


@dataclass(frozen=True, slots=True)
class HostFile:
    """A file of this machine copied into an image at ``dest``.

    ``candidates`` are tried in order (a source tree copy, then the Go module
    cache); ``ready``, when set, must exist first: the add-on builds write
    their binaries in place and stamp them when complete."""

    dest: str
    candidates: tuple[Path, ...]
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    ready: Path | None = None
    hint: str = ""

    def source(self) -> Path:
        hint = f" ({self.hint})" if self.hint else ""
        if self.ready is not None and not self.ready.is_file():
            raise MissingInputError(f"{self.dest}: {self.ready} is missing{hint}")
        for candidate in self.candidates:
            if candidate.is_file():
                return candidate
        tried = ", ".join(str(c) for c in self.candidates)
        raise MissingInputError(f"{self.dest}: none of {tried} exists{hint}")

    def data(self) -> bytes:
        return self.source().read_bytes()

    def sha256(self) -> str:
        return file_sha256(self.source())


@dataclass(frozen=True, slots=True)
class InlineFile:
    """A file whose content is part of the recipe."""

    dest: str
    content: bytes
    mode: int = 0o644
    uid: int = 0
    gid: int = 0

    def data(self) -> bytes:
        return self.content

    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


FileSpec = HostFile | InlineFile


def _file_fingerprint(f: FileSpec) -> dict[str, Any]:
    return {"dest": f.dest, "mode": f.mode, "uid": f.uid, "gid": f.gid, "sha256": f.sha256()}


def _rel(path: str) -> str:
    """An absolute image path as a layer entry name (``etc/passwd``)."""
    rel = path.strip("/")
    if not path.startswith("/") or not rel or ".." in rel.split("/"):
        raise ImageBuildError(f"not an absolute path inside the image: {path!r}")
    return rel


@dataclass(frozen=True, slots=True)
class Dir:
    path: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


# --- layers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FilesLayer:
    """Files, directories and symlinks written by ``images.TarWriter``:
    root-owned unless told, mtime 0, sorted, every parent directory
    present (0755 unless listed in ``dirs``)."""

    files: tuple[FileSpec, ...] = ()
    dirs: tuple[Dir, ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()  # (path, target)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": "files",
            "files": sorted((_file_fingerprint(f) for f in self.files), key=lambda d: d["dest"]),
            "dirs": sorted([d.path, d.mode, d.uid, d.gid] for d in self.dirs),
            "symlinks": sorted(list(s) for s in self.symlinks),
        }

    def describe(self) -> str:
        return "files: " + " ".join(sorted(f.dest for f in self.files))

    def tar(self) -> bytes:
        dirs = {_rel(d.path): d for d in self.dirs}
        paths = [f.dest for f in self.files] + [s[0] for s in self.symlinks]
        for path in paths + [d.path for d in self.dirs]:
            parts = _rel(path).split("/")
            for i in range(1, len(parts)):
                dirs.setdefault("/".join(parts[:i]), Dir("/" + "/".join(parts[:i])))
        t = TarWriter()
        for name in sorted(dirs):
            d = dirs[name]
            t.dir(name, d.mode, uid=d.uid, gid=d.gid)
        for f in sorted(self.files, key=lambda f: f.dest):
            t.file(_rel(f.dest), f.data(), f.mode, uid=f.uid, gid=f.gid)
        for path, target in sorted(self.symlinks):
            t.symlink(_rel(path), target)
        return t.close()

    def write_tar(self, out: IO[bytes], work: Path) -> None:
        out.write(self.tar())


@dataclass(frozen=True, slots=True)
class BuiltLayer:
    """A layer made by one of ``images``' builders from host files (given
    to ``make`` in order); ``builder`` names it in the stamp."""

    builder: str
    make: Callable[..., bytes] = field(compare=False)
    inputs: tuple[HostFile, ...] = ()

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": "built",
            "builder": self.builder,
            "inputs": [f.sha256() for f in self.inputs],
        }

    def describe(self) -> str:
        return f"{self.builder} layer"

    def write_tar(self, out: IO[bytes], work: Path) -> None:
        out.write(self.make(*(f.source() for f in self.inputs)))


# Nothing a container needs at run time; --dpkgopt filters are applied as
# packages are unpacked, so the files are never written.
DPKG_FILTERS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",  # licences stay
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
)
# Before the recipe's own hooks: drop what mmdebstrap copied from this machine
# (the runtime provides resolv.conf and hostname), apt's package lists and
# downloaded packages (mmdebstrap's own cleanup left 90 MB of them in minbase
# builds here), dpkg's and debconf's backups, logs, and ldconfig's auxiliary
# cache (it differs per build), and what the package scripts left in /run
# (mmdebstrap's own /run cleanup is skipped: it would run after the hooks).
# The directories stay: `apt-get update && apt-get install` works in a derived
# image.
CLEANUP_HOOK = (
    'rm -f "$1/etc/resolv.conf" "$1/etc/hostname" "$1/var/cache/ldconfig/aux-cache"'
    ' "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/cache/apt/*.bin'
    ' && for d in "$1/var/lib/apt/lists" "$1/var/cache/apt/archives" "$1/var/log"; do'
    ' if [ -d "$d" ]; then find "$d" -type f -delete; fi; done'
    ' && rm -rf "$1"/tmp/* "$1/root/.cache"'
    ' && find "$1/run" -mindepth 1 -maxdepth 1 ! -name lock -exec rm -rf {} +'
)
# mmdebstrap makes device nodes in the tar; the container runtime provides
# /dev, and a layer with device nodes cannot be unpacked without privilege.
_DROPPED_PREFIXES = ("./dev/", "dev/")


@dataclass(frozen=True, slots=True)
class DebianLayer:
    """A Debian root filesystem (``mmdebstrap --variant=VARIANT
    --include=PACKAGES``). After the packages, ``CLEANUP_HOOK`` runs, then
    the recipe's ``hooks`` (shell, ``$1`` is the root filesystem, as
    mmdebstrap's ``--customize-hook``), then ``files`` are installed (they may
    land in places the hooks made, e.g. a user's home), then each of
    ``checks`` runs inside it (``chroot``) and fails the build if it fails;
    checks must leave nothing behind. ``exclude`` adds dpkg path filters to ``DPKG_FILTERS``: files
    of installed packages that are never used in this image (dpkg keeps the
    packages installed, so apt stays consistent in a derived image).

    Recommends are not installed (mmdebstrap's default). /usr is merged the
    way Debian 12 does it, without pulling in the ``usrmerge`` package and
    its Perl."""

    packages: tuple[str, ...]
    suite: str = DEBIAN_SUITE
    variant: str = "minbase"
    hooks: tuple[str, ...] = ()
    files: tuple[FileSpec, ...] = ()
    checks: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": "debian",
            "exclude": list(self.exclude),
            "suite": self.suite,
            "variant": self.variant,
            "packages": sorted(self.packages),
            "hooks": list(self.hooks),
            "files": [_file_fingerprint(f) for f in self.files],
            "checks": list(self.checks),
            "dpkg": list(DPKG_FILTERS),
            "cleanup": CLEANUP_HOOK,
            "epoch": SOURCE_DATE_EPOCH,
        }

    def describe(self) -> str:
        return f"mmdebstrap --variant={self.variant} {self.suite}: {' '.join(self.packages)}"

    def mirrors(self) -> list[str]:
        main = os.environ.get(DEBIAN_MIRROR_ENV, "http://deb.debian.org/debian")
        security = os.environ.get(
            DEBIAN_SECURITY_MIRROR_ENV, "http://deb.debian.org/debian-security"
        )
        return [
            f"deb {main} {self.suite} main",
            f"deb {main} {self.suite}-updates main",
            f"deb {security} {self.suite}-security main",
        ]

    def command(self, work: Path) -> list[str]:
        """The mmdebstrap command line; inline files are written under
        ``work`` for the install hooks to copy."""
        # The cleanup first, so that what the recipe's hooks make stays (a
        # directory in /run, which mmdebstrap's own cleanup would empty).
        hooks = [CLEANUP_HOOK, *self.hooks]
        for i, f in enumerate(self.files):
            src = f.source() if isinstance(f, HostFile) else work / f"file-{i}"
            if isinstance(f, InlineFile):
                src.write_bytes(f.content)
            hooks.append(
                f"install -D -m {f.mode:o} -o {f.uid} -g {f.gid} {shlex.quote(str(src))}"
                f' "$1"{shlex.quote(f.dest)}'
            )
        # No bytecode written by the checks: it would land in the image.
        hooks += [
            f'chroot "$1" env PYTHONDONTWRITEBYTECODE=1 /bin/sh -ec {shlex.quote(check)}'
            for check in self.checks
        ]
        return [
            "mmdebstrap",
            "--mode=root",
            f"--variant={self.variant}",
            *([f"--include={','.join(self.packages)}"] if self.packages else []),
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
            '--aptopt=Acquire::Retries "3"',
            "--dpkgopt=force-unsafe-io",
            "--skip=cleanup/run",
            *(f"--dpkgopt={f}" for f in DPKG_FILTERS),
            *(f"--dpkgopt=path-exclude={path}" for path in self.exclude),
            *(f"--customize-hook={h}" for h in hooks),
            "--format=tar",
            self.suite,
            "-",
            *self.mirrors(),
        ]

    def write_tar(self, out: IO[bytes], work: Path) -> None:
        if os.geteuid() != 0:
            raise ImageBuildError("Debian images are built as root (mmdebstrap's root mode)")
        if shutil.which("mmdebstrap") is None:
            raise MissingInputError("mmdebstrap is not installed (apt-get install mmdebstrap)")
        # HOST_PYTHON: this interpreter, for hooks that build wheels on the
        # host (its path is not an input: the hooks name the variable).
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(SOURCE_DATE_EPOCH), HOST_PYTHON=sys.executable)
        # mmdebstrap's progress goes to our stderr; its stdout is the tar.
        proc = subprocess.Popen(self.command(work), stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        try:
            try:
                _copy_tar(proc.stdout, out)
            finally:
                proc.stdout.close()
                rc = proc.wait()
            if rc != 0:
                raise ImageBuildError(f"mmdebstrap failed (exit {rc})")
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise


def _copy_tar(source: IO[bytes], out: IO[bytes]) -> None:
    """Copy a tar stream to ``out``, without the entries under /dev."""
    # tarfile's stream modes only read and write; its type asks for more.
    out_file = cast(Any, out)
    with (
        tarfile.open(fileobj=source, mode="r|") as src,
        tarfile.open(fileobj=out_file, mode="w|", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src:
            if member.name.startswith(_DROPPED_PREFIXES):
                continue
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)


Layer = FilesLayer | BuiltLayer | DebianLayer


# --- images -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImageRecipe:
    """One image: its layers, bottom first, and its config (an empty
    ``user`` runs as root, like an image without USER)."""

    name: str
    tag: str
    layers: tuple[Layer, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: str = ""
    workdir: str = "/"
    env: tuple[str, ...] = (PATH_ENV,)
    summary: str = ""
    # Where the image's name lives: the project's system images are
    # gpuclusters.io/NAME; other sets keep their upstream names (the
    # conformance images, registry.k8s.io/e2e-test-images/NAME).
    prefix: str = REPOSITORY_PREFIX

    @property
    def repository(self) -> str:
        return f"{self.prefix}/{self.name}"

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"

    def archive(self, cache: Path) -> Path:
        return cache / f"{self.name}_{self.tag}.tar"

    def stamp(self, cache: Path) -> Path:
        return cache / f".{self.name}_{self.tag}.json"

    def image_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {}
        if self.env:
            config["Env"] = list(self.env)
        if self.entrypoint:
            config["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            config["Cmd"] = list(self.cmd)
        if self.user:
            config["User"] = self.user
        if self.workdir:
            config["WorkingDir"] = self.workdir
        return config

    def umoci_config(self) -> umoci.ImageConfig:
        return umoci.ImageConfig(
            entrypoint=self.entrypoint,
            cmd=self.cmd,
            env=self.env,
            user=self.user,
            workdir=self.workdir,
        )

    def fingerprint(self) -> dict[str, Any]:
        """Everything the archive is made from; raises MissingInputError."""
        return {
            "recipe_version": RECIPE_VERSION,
            "ref": self.ref,
            "config": self.image_config(),
            "layers": [layer.fingerprint() for layer in self.layers],
        }

    def inputs_hash(self) -> str:
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


# The files of a distroless-like image (gcr.io/distroless/static): users
# root, nobody and nonroot (65532), CA certificates, a sticky /tmp.
PASSWD = (
    b"root:x:0:0:root:/root:/sbin/nologin\n"
    b"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
    b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
)
GROUP = b"root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def static_files() -> tuple[tuple[FileSpec, ...], tuple[Dir, ...]]:
    files: tuple[FileSpec, ...] = (
        InlineFile("/etc/passwd", PASSWD),
        InlineFile("/etc/group", GROUP),
        # Go's resolver reads it: hosts file first, then DNS.
        InlineFile("/etc/nsswitch.conf", b"hosts: files dns\n"),
        HostFile(CA_BUNDLE.as_posix(), (CA_BUNDLE,), hint="apt-get install ca-certificates"),
    )
    dirs = (
        Dir("/tmp", 0o1777),
        Dir("/root", 0o700),
        Dir("/home/nonroot", 0o700, 65532, 65532),
    )
    return files, dirs


def static_image(
    name: str,
    tag: str,
    binary: HostFile,
    *,
    entrypoint: tuple[str, ...],
    cmd: tuple[str, ...] = (),
    user: str = "65532:65532",
    extra_files: tuple[FileSpec, ...] = (),
    summary: str = "",
) -> ImageRecipe:
    """A statically linked binary in a one-layer, distroless-like image."""
    files, dirs = static_files()
    layer = FilesLayer(files=(binary, *files, *extra_files), dirs=dirs)
    return ImageRecipe(
        name,
        tag,
        (layer,),
        entrypoint=entrypoint,
        cmd=cmd,
        user=user,
        summary=summary,
    )


def debian_image(
    name: str,
    tag: str,
    packages: Sequence[str],
    *,
    variant: str = "minbase",
    hooks: Sequence[str] = (),
    files: Sequence[FileSpec] = (),
    checks: Sequence[str] = (),
    exclude: Sequence[str] = (),
    extra_files: Sequence[FileSpec] = (),
    entrypoint: tuple[str, ...] = (),
    cmd: tuple[str, ...] = ("bash",),
    user: str = "",
    workdir: str = "/",
    env: tuple[str, ...] = (PATH_ENV,),
    summary: str = "",
) -> ImageRecipe:
    """A Debian image: one root filesystem layer, and a second one with
    ``extra_files`` (binaries built here) when given, so that a new binary
    is a new small layer on the same base. ``files`` go into the root
    filesystem itself (after ``hooks``)."""
    layers: list[Layer] = [
        DebianLayer(
            tuple(packages),
            variant=variant,
            hooks=tuple(hooks),
            files=tuple(files),
            checks=tuple(checks),
            exclude=tuple(exclude),
        )
    ]
    if extra_files:
        layers.append(FilesLayer(files=tuple(extra_files)))
    return ImageRecipe(
        name,
        tag,
        tuple(layers),
        entrypoint=entrypoint,
        cmd=cmd,
        user=user,
        workdir=workdir,
        env=env,
        summary=summary,
    )


# --- the catalog ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sources:
    """Where this machine keeps the recipes' inputs (the same environment
    overrides as the build scripts)."""

    addons: Path  # scripts/build-k8s-addons' cache
    k8s_bin: Path  # scripts/build-k8s' binaries
    k8s_ready: Path | None  # its completion stamp
    gomodcache: Path

    @classmethod
    def from_env(cls) -> Sources:
        k8s_bin = os.environ.get("GPUCLUSTERS_K8S_BIN")
        return cls(
            addons=Path(
                os.environ.get("GPUCLUSTERS_ADDONS_CACHE", "/var/cache/gpuclusters/addons")
            ),
            k8s_bin=Path(k8s_bin) if k8s_bin else k8s_config.DEFAULT_BIN_DIR,
            k8s_ready=None if k8s_bin else k8s_config.DEFAULT_BIN_DIR.parent / ".complete",
            gomodcache=Path(os.environ.get("GOMODCACHE", Path.home() / "go" / "pkg" / "mod")),
        )

    def addon_binary(
        self, addon: str, version: str, binary: str, dest: str, *, mode: int = 0o755
    ) -> HostFile:
        return HostFile(
            dest,
            (self.addons / "bin" / binary,),
            mode=mode,
            ready=self.addons / f".{addon}-{version}.complete",
            hint=f"run scripts/build-k8s-addons {addon}",
        )

    def addon_source(self, addon: str, module: str, path: str, dest: str, mode: int) -> HostFile:
        """A file of an add-on's released module: the build's copy of it, or
        the Go module cache."""
        return HostFile(
            dest,
            (self.addons / "src" / addon / path, self.gomodcache / module / path),
            mode=mode,
            hint=f"run scripts/build-k8s-addons {addon}",
        )

    def k8s_binary(self, binary: str, dest: str, *, mode: int = 0o755) -> HostFile:
        return HostFile(
            dest,
            (self.k8s_bin / binary,),
            mode=mode,
            ready=self.k8s_ready,
            hint="run scripts/build-k8s",
        )


# Kubeflow MPI Operator's base image (build/base/Dockerfile and sshd_config
# in github.com/kubeflow/mpi-operator@v0.8.0), rebuilt on Debian 12: sshd and
# ssh on port 2222, no host key checking (the operator mounts the keys from a
# Secret, read-only, so no known_hosts can be written), user mpiuser (1000)
# whose ~/.sshd_config lets a worker run `sshd -De -f /home/mpiuser/.sshd_config`
# as that user, as upstream's examples do.
MPI_SSH_PORT = 2222
MPI_SSH_CONFIG = (
    b"# Kubeflow MPI Operator: workers' sshd listens on 2222; the operator's keys\n"
    b"# come from a read-only Secret, so no known_hosts is kept.\n"
    b"Host *\n"
    b"    StrictHostKeyChecking no\n"
    b"    UserKnownHostsFile /dev/null\n"
    b"    Port %d\n" % MPI_SSH_PORT
)
MPI_SSHD_CONFIG = b"Port %d\nStrictModes no\n" % MPI_SSH_PORT
MPI_USER_SSHD_CONFIG = (
    b"PidFile /home/mpiuser/sshd.pid\n"
    b"HostKey /home/mpiuser/.ssh/id_rsa\n"
    b"StrictModes no\n"
    b"Port %d\n" % MPI_SSH_PORT
)


# torchrun of Debian 12's PyTorch 1.13 fails at every launch on Python 3.11:
# `Std.from_str("0")` (the default --redirects and --tee) finds no member,
# because iterating a Flag yields only its single-bit members now, and returns
# None (so do "3" and mappings). The equivalent of PyTorch 2.0's fix (look the
# value up as `Std(v)`), applied to the installed file, its bytecode recompiled
# hash-checked like the rest; a no-op once the package has a fix.
TORCH_STD_FILE = "/usr/lib/python3/dist-packages/torch/distributed/elastic/multiprocessing/api.py"
TORCH_STD_FIX = f"""
import pathlib
p = pathlib.Path({TORCH_STD_FILE!r})
old = "            v = int(v)\\n            for s in Std:\\n                if s == v:\\n"
new = "            v = int(v)\\n            for s in [Std(v)]:\\n                if s == v:\\n"
text = p.read_text()
if old in text:
    p.write_text(text.replace(old, new))
"""
TORCH_STD_FIX_HOOK = (
    f'chroot "$1" python3 -c {shlex.quote(TORCH_STD_FIX)}'
    f' && chroot "$1" python3 -m compileall -q --invalidation-mode checked-hash'
    f" {TORCH_STD_FILE}"
)


# SkyPilot's pod bootstrap installs, unless already there, eight tools with
# apt, uv with curl from astral.sh, a venv ~/skypilot-runtime with Ray and
# SkyPilot from PyPI: all of it is put in the image, so a launch fetches
# nothing. The wheels are built on this machine (the pip of the Python that
# runs this build, $HOST_PYTHON: a CPython 3.11 like Debian's) into the root
# filesystem, installed from there with no index, and removed; uv is the
# binary of its wheel.
_SKY_WHEELS = "/opt/skypilot-wheels"
_SKY_REQS = " ".join(shlex.quote(r) for r in SKYPILOT_RUNTIME)
SKYPILOT_HOOKS = (
    f'mkdir -p "$1{_SKY_WHEELS}" "$1/root/.local/bin"'
    f' && "$HOST_PYTHON" -m pip wheel -q --disable-pip-version-check -w "$1{_SKY_WHEELS}"'
    f" {_SKY_REQS} pip wheel uv==0.13.9",
    f'd=$(mktemp -d) && "$HOST_PYTHON" -m zipfile -e "$1{_SKY_WHEELS}"/uv-*.whl "$d"'
    ' && install -m 0755 "$d"/uv-*.data/scripts/uv "$d"/uv-*.data/scripts/uvx "$1/root/.local/bin/"'
    ' && rm -rf "$d"',
    f'chroot "$1" env HOME=/root /root/.local/bin/uv venv -q --seed --no-index'
    f" --find-links {_SKY_WHEELS} --python /usr/bin/python3 /root/skypilot-runtime",
    f'chroot "$1" env HOME=/root VIRTUAL_ENV=/root/skypilot-runtime UV_LINK_MODE=copy'
    f" /root/.local/bin/uv pip install -q --no-index --find-links {_SKY_WHEELS} {_SKY_REQS}",
    # The bootstrap makes its own host keys (ssh-keygen -A) and caches nothing.
    f'rm -rf "$1{_SKY_WHEELS}" "$1/root/.cache" "$1"/etc/ssh/ssh_host_*',
)


def default_recipes(src: Sources | None = None) -> list[ImageRecipe]:
    """Every system image. The Go tools' images mirror the upstream
    Dockerfiles (path, entrypoint, user); the upstream manifests name the
    binary by path or rely on the entrypoint."""
    src = src or Sources.from_env()
    k8s_version = f"v{k8s_config.K8S_VERSION}"
    volcano_module = f"volcano.sh/volcano@{VOLCANO_VERSION}"
    return [
        ImageRecipe(
            "pause",
            k8s_version,
            (BuiltLayer("pause", images.pause_layer, (src.k8s_binary("pause", "/pause"),)),),
            entrypoint=("/pause",),
            user="65535:65535",
            env=(),
            workdir="",
            summary="pod sandbox (Kubernetes' build/pause)",
        ),
        ImageRecipe(
            "base",
            "latest",
            (
                BuiltLayer(
                    "base",
                    images.base_layer,
                    (HostFile("/bin/busybox", (images.BUSYBOX,), hint="install busybox-static"),),
                ),
            ),
            cmd=("/bin/sh",),
            summary="busybox: a shell and the usual tools",
        ),
        # Dockerfile: distroless/static:nonroot, USER 65532:65532,
        # ENTRYPOINT /manager; config/components/manager: command /manager,
        # runAsNonRoot with no runAsUser (so the image's user must be numeric).
        static_image(
            "kueue",
            KUEUE_VERSION,
            src.addon_binary("kueue", KUEUE_VERSION, "kueue", "/manager"),
            entrypoint=("/manager",),
            user="65532:65532",
            summary="Kueue controller manager",
        ),
        # Dockerfile: distroless/base-debian12 (root), ENTRYPOINT
        # /opt/mpi-operator, CMD --help; deploy/v2beta1 passes args only.
        static_image(
            "mpi-operator",
            MPI_OPERATOR_VERSION,
            src.addon_binary(
                "mpi-operator", MPI_OPERATOR_VERSION, "mpi-operator", "/opt/mpi-operator"
            ),
            entrypoint=("/opt/mpi-operator",),
            cmd=("--help",),
            user="",
            summary="Kubeflow MPI Operator (v2beta1 MPIJobs)",
        ),
        # installer/dockerfile/*: alpine (root), the binary at /<name>,
        # ENTRYPOINT it; volcano-development.yaml sets runAsUser 1000.
        static_image(
            "vc-scheduler",
            VOLCANO_VERSION,
            src.addon_binary("volcano", VOLCANO_VERSION, "vc-scheduler", "/vc-scheduler"),
            entrypoint=("/vc-scheduler",),
            user="",
            summary="Volcano scheduler",
        ),
        static_image(
            "vc-controller-manager",
            VOLCANO_VERSION,
            src.addon_binary(
                "volcano", VOLCANO_VERSION, "vc-controller-manager", "/vc-controller-manager"
            ),
            entrypoint=("/vc-controller-manager",),
            user="",
            summary="Volcano controller manager",
        ),
        # Also the image of the `volcano-admission-init` Job, which runs
        # `./gen-admission-secret.sh` from / as user 1000: a script for
        # busybox's sh with bash syntax ([[ ]], `function`), calling
        # openssl, kubectl, base64 and tr. Debian's /bin/sh (dash) cannot run
        # it, so /bin/sh is bash here; kubectl is the cluster's own version.
        debian_image(
            "vc-webhook-manager",
            VOLCANO_VERSION,
            ("openssl", "ca-certificates"),
            variant="essential",
            hooks=('ln -sf bash "$1/usr/bin/sh"',),
            checks=(
                '[ "$(readlink /usr/bin/sh)" = bash ] && openssl version >/dev/null'
                " && [ -s /etc/ssl/certs/ca-certificates.crt ]",
            ),
            extra_files=(
                src.addon_binary(
                    "volcano", VOLCANO_VERSION, "vc-webhook-manager", "/vc-webhook-manager"
                ),
                src.addon_source(
                    "volcano",
                    volcano_module,
                    "installer/dockerfile/webhook-manager/gen-admission-secret.sh",
                    "/gen-admission-secret.sh",
                    0o755,
                ),
                src.k8s_binary("kubectl", "/usr/local/bin/kubectl"),
            ),
            entrypoint=("/vc-webhook-manager",),
            cmd=(),
            summary="Volcano admission webhooks and their certificate Job",
        ),
        debian_image(
            "mpi",
            DEBIAN_SUITE,
            (
                "openmpi-bin",
                "openssh-server",
                "openssh-client",
                "python3",
                "python3-mpi4py",
            ),
            hooks=(
                'chroot "$1" useradd --create-home --uid 1000 mpiuser',
                # For a worker whose sshd runs as root (`sshd -De`, with
                # the image's host keys, which openssh-server's postinst made
                # as in upstream's image; host keys are not checked): its
                # privilege separation directory. Workers run as mpiuser use
                # ~/.sshd_config and the operator's key instead.
                'mkdir -p "$1/run/sshd"',
            ),
            files=(
                InlineFile("/etc/ssh/ssh_config.d/mpi-operator.conf", MPI_SSH_CONFIG),
                InlineFile("/etc/ssh/sshd_config.d/mpi-operator.conf", MPI_SSHD_CONFIG),
                InlineFile("/home/mpiuser/.sshd_config", MPI_USER_SSHD_CONFIG, 0o644, 1000, 1000),
            ),
            checks=(
                "id -u mpiuser | grep -qx 1000",
                "mpirun --version >/dev/null && test -x /usr/sbin/sshd",
                "python3 -c 'import mpi4py.MPI'",
                "ssh -G workerhost </dev/null 2>/dev/null | grep -qix 'port 2222'",
            ),
            workdir="/home/mpiuser",
            # OpenMPI's shared-memory transport tries to copy between
            # processes with CMA (process_vm_readv), which a container
            # without CAP_SYS_PTRACE is refused; plain copies work anywhere.
            env=(PATH_ENV, "OMPI_MCA_btl_vader_single_copy_mechanism=none"),
            summary="OpenMPI 4.1 + sshd for Kubeflow MPIJobs (launcher and workers)",
        ),
        debian_image(
            "torch",
            DEBIAN_SUITE,
            ("python3", "python3-torch", "python3-numpy", "libopenblas0-pthread"),
            files=(
                # Debian ships the module, not the console script.
                InlineFile(
                    "/usr/local/bin/torchrun",
                    b'#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n',
                    0o755,
                ),
            ),
            hooks=(TORCH_STD_FIX_HOOK,),
            checks=(
                "python3 -c 'import torch.distributed as d;"
                ' assert d.is_available() and d.is_gloo_available(), "no gloo"\'',
                "python3 -m torch.distributed.run --help >/dev/null",
                # torchrun launches two processes that all-reduce with gloo;
                # everything in a scratch directory (torchrun's too: TMPDIR).
                # The chroot has no /etc/hosts, so no "localhost" (--standalone).
                "d=$(mktemp -d) && printf '%s\\n' 'import torch, torch.distributed as d'"
                " 'd.init_process_group(\"gloo\")'"
                " 't = torch.ones(1) * (d.get_rank() + 1)' 'd.all_reduce(t)'"
                " 'assert t.item() == 3.0, t' >$d/check.py"
                " && port=$(python3 -c 'import socket; s = socket.socket();"
                ' s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])\')'
                " && TMPDIR=$d GLOO_SOCKET_IFNAME=lo torchrun --nnodes=1 --nproc_per_node=2"
                " --master_addr=127.0.0.1 --master_port=$port $d/check.py >/dev/null"
                " && rm -rf $d",
            ),
            # Pulled in through OpenCV and FFmpeg, which libtorch links, but
            # never loaded by it: Mesa's GL drivers and the LLVM and Z3 they
            # link (165 MB), libtorch's C++ test programs (51 MB), PROJ's
            # data (23 MB; GDAL's projections).
            exclude=(
                "/usr/lib/x86_64-linux-gnu/dri/*",
                "/usr/lib/x86_64-linux-gnu/libLLVM-15.so*",
                "/usr/lib/x86_64-linux-gnu/libz3.so*",
                "/usr/lib/libtorch-test/*",
                "/usr/share/proj/*",
            ),
            cmd=("python3",),
            summary="PyTorch 1.13 (CPU, gloo) from Debian 12, with torchrun",
        ),
        debian_image(
            "skypilot",
            SKYPILOT_VERSION,
            (
                # the bootstrap's check: rsync curl wget nc gcc patch lspci sshd
                "rsync",
                "curl",
                "wget",
                "netcat-openbsd",
                "gcc",
                "libc6-dev",
                "patch",
                "pciutils",
                "openssh-server",
                "openssh-client",
                # what its scripts run besides: pgrep, sudo (even as root), awk
                "python3",
                "procps",
                "sudo",
                "mawk",
                "hostname",
                "ca-certificates",
            ),
            hooks=SKYPILOT_HOOKS,
            checks=(
                "for t in rsync curl wget nc gcc patch lspci sshd sudo pgrep; do"
                ' command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done',
                "HOME=/root /root/.local/bin/uv -V >/dev/null",
                "/root/skypilot-runtime/bin/python -c 'import sky, ray;"
                f' assert sky.__version__ == "{SKYPILOT_VERSION}", sky.__version__;'
                ' assert ray.__version__ == "2.9.3", ray.__version__\'',
            ),
            workdir="/root",
            cmd=(),
            # UV_OFFLINE: the wheel the laptop syncs installs from what the
            # venv holds (uv has no variable for --no-index).
            env=(PATH_ENV, "HOME=/root", "LANG=C.UTF-8", "UV_OFFLINE=1"),
            summary=f"SkyPilot {SKYPILOT_VERSION} pod runtime (Ray 2.9.3, uv) on Debian 12",
        ),
    ]


# Archive names are <name>_<tag>.tar, split at the first "_" by their readers
# (server/registry_daemon.py): no "_" in a name; a tag as OCI allows.
_NAME = re.compile(r"[a-z0-9]+(?:[.-][a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def catalog(src: Sources | None = None) -> dict[str, ImageRecipe]:
    recipes: dict[str, ImageRecipe] = {}
    for recipe in default_recipes(src):
        if not _NAME.fullmatch(recipe.name) or not _TAG.fullmatch(recipe.tag):
            raise ImageBuildError(f"bad image name or tag: {recipe.name}:{recipe.tag}")
        if recipe.name in recipes:
            raise ImageBuildError(f"two recipes for {recipe.name}")
        recipes[recipe.name] = recipe
    return recipes


# --- building ---------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE))


@dataclass(frozen=True, slots=True)
class ImageState:
    recipe: ImageRecipe
    archive: Path
    present: bool  # the archive exists
    status: str  # up-to-date | stale | missing
    missing_input: str | None  # why it cannot be built now
    stamp: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.recipe.name,
            "tag": self.recipe.tag,
            "ref": self.recipe.ref,
            "repository": self.recipe.repository,
            "archive": str(self.archive),
            "present": self.present,
            "status": self.status,
            "inputs_ready": self.missing_input is None,
            "missing_input": self.missing_input,
            "size": self.archive.stat().st_size if self.present else None,
            "manifest_digest": self.stamp.get("manifest_digest") if self.present else None,
            "summary": self.recipe.summary,
        }


def _read_stamp(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def state(recipe: ImageRecipe, cache: Path) -> ImageState:
    archive = recipe.archive(cache)
    stamp = _read_stamp(recipe.stamp(cache))
    present = archive.is_file()
    try:
        inputs: str | None = recipe.inputs_hash()
        missing = None
    except MissingInputError as exc:
        inputs, missing = None, str(exc)
    if not present:
        status = "missing"
    elif stamp.get("size") != archive.stat().st_size:
        status = "stale"  # not the archive the stamp describes
    elif inputs is None:
        # The inputs are gone (a cleaned build cache): the archive is what
        # they last made, and stays usable.
        status = "up-to-date" if stamp.get("inputs") else "stale"
    else:
        status = "up-to-date" if stamp.get("inputs") == inputs else "stale"
    return ImageState(recipe, archive, present, status, missing, stamp)


@contextlib.contextmanager
def _locked(cache: Path, recipe: ImageRecipe) -> Iterator[None]:
    """One build of an image at a time (scripts/setup's background builder
    and a developer's run may overlap); different images build side by side."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{recipe.name}_{recipe.tag}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_image(recipe: ImageRecipe, cache: Path, *, force: bool = False) -> str:
    """Build one image into the cache unless its stamp says it is current;
    returns ``built`` or ``up-to-date``. Raises MissingInputError or
    ImageBuildError."""
    archive, stamp_path = recipe.archive(cache), recipe.stamp(cache)
    inputs = recipe.inputs_hash()
    stamp = _read_stamp(stamp_path)
    if (
        not force
        and archive.is_file()
        and stamp.get("inputs") == inputs
        and stamp.get("size") == archive.stat().st_size
    ):
        return "up-to-date"
    say(f"{recipe.ref}: building ({len(recipe.layers)} layer(s))")
    started = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    # Scratch space on the cache's file system: blobs are renamed, not copied.
    work = Path(tempfile.mkdtemp(prefix=f".work-{recipe.name}-", dir=cache))
    try:
        packed = umoci.build_archive(
            archive,
            recipe.tag,
            [(_timed(recipe, i, work), layer.describe()) for i, layer in enumerate(recipe.layers)],
            recipe.umoci_config(),
            work,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    size = archive.stat().st_size
    new_stamp = {
        "ref": recipe.ref,
        "inputs": inputs,
        "manifest_digest": packed.manifest_digest,
        "size": size,
        "layers": [
            {"digest": b.digest, "diff_id": b.diff_id, "size": b.size} for b in packed.layers
        ],
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
        "fingerprint": recipe.fingerprint(),
    }
    tmp = stamp_path.with_name(stamp_path.name + ".tmp")
    tmp.write_text(json.dumps(new_stamp, indent=1, sort_keys=True) + "\n")
    tmp.replace(stamp_path)
    say(f"{recipe.ref}: built {archive} ({_mb(size)}) in {seconds:.1f} s")
    return "built"


def _timed(recipe: ImageRecipe, i: int, work: Path) -> umoci.TarSource:
    """Layer ``i``'s tar source, saying how long it took once umoci has it."""
    layer = recipe.layers[i]

    def write(out: IO[bytes]) -> None:
        started = time.monotonic()
        layer.write_tar(out, work)
        say(
            f"{recipe.ref}: layer {i + 1}/{len(recipe.layers)} ({layer.describe()[:60]}):"
            f" {time.monotonic() - started:.1f} s"
        )

    return write


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _select(recipes: Sequence[ImageRecipe], names: Sequence[str]) -> list[ImageRecipe]:
    """The recipes ``names`` pick: a name (every tag of it), name:tag, or the
    full reference; all of them when none is given."""
    if not names:
        return list(recipes)
    chosen: list[ImageRecipe] = []
    for name in names:
        picked = [r for r in recipes if name in (r.name, f"{r.name}:{r.tag}", r.repository, r.ref)]
        if not picked:
            known = ", ".join(f"{r.name}:{r.tag}" for r in recipes)
            raise SystemExit(f"image_catalog: unknown image {name!r} (known: {known})")
        chosen.extend(r for r in picked if r not in chosen)
    return chosen


def run_cli(
    argv: Sequence[str] | None,
    recipes: Callable[[], Sequence[ImageRecipe]],
    *,
    prog: str,
    description: str,
    default_cache: Callable[[], Path],
    cache_help: str,
) -> int:
    """``build | list | check`` over a set of recipes (the system images
    here, the conformance images in ``imagebuild.conformance``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--cache", type=Path, help=f"archive directory ({cache_help})")
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build images that are missing or stale")
    p_build.add_argument("names", nargs="*", metavar="NAME")
    p_build.add_argument("--force", action="store_true", help="rebuild even if current")
    p_list = sub.add_parser("list", help="every image and its archive")
    p_list.add_argument("--output", choices=("text", "json"), default="text")
    p_check = sub.add_parser("check", help="exit 0 if the images are built and current")
    p_check.add_argument("names", nargs="*", metavar="NAME")
    args = parser.parse_args(argv)

    cache: Path = args.cache or default_cache()
    all_recipes = list(recipes())

    if args.command == "list":
        states = [state(r, cache) for r in all_recipes]
        if args.output == "json":
            print(json.dumps([s.as_json() for s in states], indent=1))
        else:
            for s in states:
                extra = f"  (cannot build: {s.missing_input})" if s.missing_input else ""
                print(f"{s.recipe.ref:45} {s.status:10} {s.archive}{extra}")
        return 0

    if args.command == "check":
        stale = [
            s
            for s in (state(r, cache) for r in _select(all_recipes, args.names))
            if s.status != "up-to-date"
        ]
        for s in stale:
            say(f"{s.recipe.ref}: {s.status}")
        return 1 if stale else 0

    failed: list[str] = []
    for recipe in _select(all_recipes, args.names):
        try:
            with _locked(cache, recipe):
                result = build_image(recipe, cache, force=args.force)
        except ImageBuildError as exc:
            say(f"{recipe.ref}: FAILED: {exc}")
            failed.append(recipe.ref)
            continue
        if result == "up-to-date":
            say(f"{recipe.ref}: up to date ({recipe.archive(cache)})")
    if failed:
        say(f"failed: {', '.join(failed)}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda: list(catalog().values()),
        prog="python -m gpuclusters.imagebuild.catalog",
        description="Build and list the system container images (OCI archives).",
        default_cache=cache_dir,
        cache_help=f"${CACHE_ENV}",
    )


if __name__ == "__main__":
    sys.exit(main())
