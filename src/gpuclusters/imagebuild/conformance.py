"""The images the Kubernetes conformance suite runs, built on this machine
without Docker (``bench/conformance.sh``; not part of any cluster).

``e2e.test`` names its images ``registry.k8s.io/e2e-test-images/NAME:TAG``
and friends (``e2e.test --list-images``); ``KUBE_TEST_REPO_LIST`` maps
those registries to the cluster's registry, where the bench pushes what is
built here. The images keep their upstream names and tags (``prefix``), so
the mapping is the only change the suite sees.

What each image must be, from the suite's use of it (the Dockerfiles under
``test/images`` of the same release):

* **agnhost** (the suite's Swiss-army binary): ``/agnhost`` as entrypoint,
  ``pause`` as command, ``/agnhost-2`` a link to it (entrypoint tests), the
  porter's TLS pair at ``/localhost.{crt,key}``, ``/uploads``, ``/coredns``,
  user 1000 ``user-defined-in-image`` in group 50000
  ``group-defined-in-image`` (supplemental groups tests), and ``dig``,
  ``curl``, ``nc``, ``ss``, ``iperf``, ``bash``. Upstream is Alpine; the
  same tools come from Debian 12 here.
* **jessie-dnsutils**: ``dig`` and friends on Debian (the DNS tests' second
  prober); upstream is Debian 8, this is Debian 12.
* **busybox**: upstream BusyBox 1.37.0 (static, defconfig; built by
  scripts/build-conformance) with every applet linked, as the base image's
  layer is made. Not Debian's busybox-static: Debian reverts upstream's ash
  change that passes environment variables whose names are not shell names
  (``data-1``) on to children, which the envFrom-prefix specs check. The
  other busybox-based images here use the same binary.
* **httpd** / **httpd-new**: upstream is Apache on Alpine serving
  ``/usr/local/apache2/htdocs`` on port 80 from ``httpd-foreground``; the
  tests probe ``/index.html`` and move it away with ``mv`` to fail the probe.
  Here busybox's ``httpd`` serves that directory from a ``httpd-foreground``
  of the same name (a stand-in: no Apache modules, which no spec uses).
* **nginx** / **nginx-new**: likewise, ``/usr/share/nginx/html`` on port 80
  from an ``nginx`` command that starts busybox's ``httpd``.
* **kitten** / **nautilus**: agnhost's ``test-webserver`` serving a picture
  and ``/data.json`` (``kubectl``'s update-demo spec reads it).
* **pause**: the release's pause, as ``pause:3.10.1``.
* **etcd**: the release's etcd at ``/usr/local/bin/etcd`` (the aggregator
  spec runs it beside the sample API server).
* **sample-apiserver**: ``k8s.io/sample-apiserver`` of the same release at
  ``/sample-apiserver`` (upstream's tag is older; the spec only needs the
  wardle API it serves).
* **nonewprivs**: ``/usr/local/bin/nnp`` set-uid root; **nonroot**: user 1234.

Command line (the same as ``imagebuild.catalog``'s)::

    python -m gpuclusters.imagebuild.conformance build [NAME...]
    python -m gpuclusters.imagebuild.conformance list [--output json]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuclusters.imagebuild.catalog import (
    BuiltLayer,
    Dir,
    FilesLayer,
    HostFile,
    ImageRecipe,
    InlineFile,
    Layer,
    Sources,
    debian_image,
    run_cli,
)
from gpuclusters.layers.kubernetes import config as k8s_config
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.addons import COREDNS_VERSION

CACHE_ENV = "GPUCLUSTERS_CONFORMANCE_IMAGES"
CONFORMANCE_CACHE_ENV = "GPUCLUSTERS_CONFORMANCE_CACHE"
DEFAULT_ROOT = Path("/var/cache/gpuclusters/conformance")

E2E_REGISTRY = "registry.k8s.io/e2e-test-images"  # promoterE2eRegistry
K8S_REGISTRY = "registry.k8s.io"  # gcRegistry, gcEtcdRegistry

AGNHOST_TAG = "2.56"


def conformance_root() -> Path:
    return Path(os.environ.get(CONFORMANCE_CACHE_ENV, DEFAULT_ROOT))


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    return Path(explicit) if explicit else conformance_root() / "images"


def _test_binary(root: Path, name: str, dest: str, mode: int = 0o755) -> HostFile:
    """A binary scripts/build-conformance made."""
    version_dir = root / f"v{k8s_config.K8S_VERSION}"
    return HostFile(
        dest,
        (version_dir / "bin" / name,),
        mode=mode,
        ready=version_dir / ".complete",
        hint="run scripts/build-conformance",
    )


def _k8s_source(src: Sources, path: str, dest: str, mode: int = 0o644) -> HostFile:
    """A file of the k8s.io/kubernetes module (test/images/...)."""
    module = src.gomodcache / f"k8s.io/kubernetes@v{k8s_config.K8S_VERSION}"
    return HostFile(dest, (module / path,), mode=mode, hint="run scripts/build-k8s")


def _busybox(root: Path) -> BuiltLayer:
    """The base image's layer (every applet linked into /bin) with
    upstream's BusyBox, as the upstream image has."""
    return BuiltLayer("base", images.base_layer, (_test_binary(root, "busybox", "/bin/busybox"),))


def _on_busybox(
    root: Path,
    name: str,
    tag: str,
    files: Sequence[HostFile | InlineFile] = (),
    *,
    dirs: Sequence[Dir] = (),
    prefix: str = E2E_REGISTRY,
    entrypoint: tuple[str, ...] = (),
    cmd: tuple[str, ...] = ("/bin/sh",),
    user: str = "",
    workdir: str = "/",
    summary: str = "",
) -> ImageRecipe:
    layers: list[Layer] = [_busybox(root)]
    if files or dirs:
        layers.append(FilesLayer(files=tuple(files), dirs=tuple(dirs)))
    return ImageRecipe(
        name,
        tag,
        tuple(layers),
        entrypoint=entrypoint,
        cmd=cmd,
        user=user,
        workdir=workdir,
        prefix=prefix,
        summary=summary,
    )


def _web_server(
    root: Path, name: str, tag: str, command: str, docroot: str, index: HostFile | InlineFile
) -> ImageRecipe:
    """httpd and nginx stand-ins: busybox httpd serving ``docroot`` on :80,
    started by a command of the upstream image's name."""
    script = f"#!/bin/sh\n# {name} stand-in: busybox httpd\nexec httpd -f -p 80 -h {docroot}\n"
    return _on_busybox(
        root,
        name,
        tag,
        (InlineFile(command, script.encode(), 0o755), index),
        cmd=(Path(command).name, *(("-g", "daemon off;") if name == "nginx" else ())),
        workdir=str(Path(docroot).parent) if name == "httpd" else "/",
        summary=f"{name} stand-in (busybox httpd serving {docroot} on port 80)",
    )


def conformance_recipes(src: Sources | None = None, root: Path | None = None) -> list[ImageRecipe]:
    src = src or Sources.from_env()
    root = root or conformance_root()
    agnhost = _test_binary(root, "agnhost", "/agnhost")
    agnhost_recipe = debian_image(
        "agnhost",
        AGNHOST_TAG,
        ("bind9-dnsutils", "curl", "netcat-openbsd", "iproute2", "iperf", "bash"),
        hooks=(
            'mkdir -p "$1/uploads" && ln -s agnhost "$1/agnhost-2"',
            'chroot "$1" groupadd -g 50000 group-defined-in-image',
            'chroot "$1" useradd -u 1000 -G group-defined-in-image user-defined-in-image',
        ),
        checks=(
            "for t in dig curl nc ss iperf bash getent; do"
            ' command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done',
            "id user-defined-in-image | grep -q 50000",
        ),
        extra_files=(
            agnhost,
            _k8s_source(src, "test/images/agnhost/porter/localhost.crt", "/localhost.crt"),
            _k8s_source(src, "test/images/agnhost/porter/localhost.key", "/localhost.key"),
            src.addon_binary("coredns", f"v{COREDNS_VERSION}", "coredns", "/coredns"),
        ),
        entrypoint=("/agnhost",),
        cmd=("pause",),
        summary="agnhost (Debian 12 tools)",
    )
    recipes = [
        ImageRecipe(
            agnhost_recipe.name,
            agnhost_recipe.tag,
            agnhost_recipe.layers,
            entrypoint=agnhost_recipe.entrypoint,
            cmd=agnhost_recipe.cmd,
            prefix=E2E_REGISTRY,
            summary=agnhost_recipe.summary,
        ),
        ImageRecipe(
            "jessie-dnsutils",
            "1.7",
            debian_image(
                "jessie-dnsutils",
                "1.7",
                ("bind9-dnsutils", "bind9-host"),
                checks=("command -v dig >/dev/null && command -v host >/dev/null",),
            ).layers,
            cmd=("bash",),
            prefix=E2E_REGISTRY,
            summary="dnsutils on Debian 12",
        ),
        _on_busybox(root, "busybox", "1.37.0-1", summary="busybox (upstream 1.37.0, static)"),
        _web_server(
            root,
            "httpd",
            "2.4.38-4",
            "/usr/local/bin/httpd-foreground",
            "/usr/local/apache2/htdocs",
            _k8s_source(
                src, "test/images/httpd/index.html", "/usr/local/apache2/htdocs/index.html"
            ),
        ),
        _web_server(
            root,
            "httpd",
            "2.4.39-4",
            "/usr/local/bin/httpd-foreground",
            "/usr/local/apache2/htdocs",
            _k8s_source(
                src, "test/images/httpd-new/index.html", "/usr/local/apache2/htdocs/index.html"
            ),
        ),
    ]
    for tag in ("1.14-4", "1.15-4"):
        recipes.append(
            _web_server(
                root,
                "nginx",
                tag,
                "/usr/sbin/nginx",
                "/usr/share/nginx/html",
                InlineFile(
                    "/usr/share/nginx/html/index.html",
                    b"<html><body><h1>Welcome to nginx!</h1></body></html>\n",
                ),
            )
        )
    for picture in ("kitten", "nautilus"):
        recipes.append(
            _on_busybox(
                root,
                picture,
                "1.7",
                (
                    agnhost,
                    _k8s_source(
                        src, f"test/images/{picture}/html/{picture}.jpg", f"/{picture}.jpg"
                    ),
                    _k8s_source(src, f"test/images/{picture}/html/data.json", "/data.json"),
                ),
                entrypoint=("/agnhost",),
                cmd=("test-webserver",),
                summary=f"agnhost test-webserver serving {picture}.jpg and /data.json",
            )
        )
    recipes += [
        ImageRecipe(
            "pause",
            "3.10.1",
            (BuiltLayer("pause", images.pause_layer, (src.k8s_binary("pause", "/pause"),)),),
            entrypoint=("/pause",),
            user="65535:65535",
            env=(),
            workdir="",
            prefix=K8S_REGISTRY,
            summary="pod sandbox (the release's build/pause)",
        ),
        ImageRecipe(
            "etcd",
            "3.6.4-0",
            (
                _busybox(root),
                FilesLayer(files=(src.k8s_binary("etcd", "/usr/local/bin/etcd"),)),
            ),
            cmd=("/usr/local/bin/etcd",),
            prefix=K8S_REGISTRY,
            summary="etcd (the release's pinned server)",
        ),
        ImageRecipe(
            "sample-apiserver",
            "1.29.2",
            (
                _busybox(root),
                FilesLayer(files=(_test_binary(root, "sample-apiserver", "/sample-apiserver"),)),
            ),
            entrypoint=("/sample-apiserver",),
            prefix=E2E_REGISTRY,
            summary="k8s.io/sample-apiserver of the release (wardle.example.com)",
        ),
        _on_busybox(
            root,
            "nonewprivs",
            "1.3",
            (_test_binary(root, "nonewprivs", "/usr/local/bin/nnp", 0o4755),),
            cmd=("nnp",),
            summary="nnp: prints whether no_new_privs is set",
        ),
        _on_busybox(root, "nonroot", "1.4", user="1234", summary="runs as user 1234"),
    ]
    return recipes


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(
        argv,
        conformance_recipes,
        prog="python -m gpuclusters.imagebuild.conformance",
        description="Build and list the images the Kubernetes conformance suite runs.",
        default_cache=cache_dir,
        cache_help=f"${CACHE_ENV}",
    )


if __name__ == "__main__":
    sys.exit(main())
