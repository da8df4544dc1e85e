"""The node's read-only image registry (layers/kubernetes/registry), served
for real on a loopback port: the /v2/ API answers manifests by tag and by
digest and blobs by digest with the archive's exact bytes, unknown names are
404 with a registry error body, archives dropped in later are picked up
without a restart, and a corrupt archive does not hide the others."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuclusters.layers.kubernetes.images import MANIFEST_MEDIA, Image, oci_archive
from gpuclusters.layers.kubernetes.registry import Store, handler_for

NS = {"ns": "localhost"}  # what containerd adds when it asks a mirror


def _layer(content: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("file")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


@dataclass(frozen=True)
class Built:
    """An archive and what a client should get back for it."""

    image: Image
    manifest_digest: str
    manifest: bytes
    config_digest: str
    layer: bytes

    @property
    def layer_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.layer).hexdigest()


def _build(name: str, content: bytes) -> Built:
    layer = _layer(content)
    archive = oci_archive(name, layer, {"Cmd": ["/bin/sh"]})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        index_file = tar.extractfile("index.json")
        assert index_file is not None
        [desc] = json.loads(index_file.read())["manifests"]
        manifest_file = tar.extractfile("blobs/sha256/" + desc["digest"].split(":", 1)[1])
        assert manifest_file is not None
        manifest = manifest_file.read()
    config_digest: str = json.loads(manifest)["config"]["digest"]
    return Built(Image(name, archive), desc["digest"], manifest, config_digest, layer)


BASE = _build("localhost/gpuclusters-base:latest", b"base\n")
PAUSE = _build("localhost/gpuclusters-pause:1.34.4", b"pause\n")
EXTRA = _build("localhost/team/tool:v1", b"extra\n")


def _write(root: Path, built: Built) -> Path:
    path = root / built.image.file_name
    path.write_bytes(built.image.archive)
    return path


@dataclass
class Registry:
    root: Path
    client: httpx.Client
    store: Store


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    root = tmp_path / "images"
    root.mkdir()
    _write(root, BASE)
    _write(root, PAUSE)
    store = Store(root)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(store))
    # A short poll interval keeps shutdown() (which waits for one) fast.
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    base_url = f"http://{host!s}:{port}"
    try:
        with httpx.Client(base_url=base_url, timeout=5) as client:
            yield Registry(root, client, store)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _errors(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.headers["content-type"] == "application/json"
    errors: list[dict[str, Any]] = response.json()["errors"]
    return errors


def test_version_check(registry: Registry) -> None:
    for path in ("/v2/", "/v2"):
        r = registry.client.get(path)
        assert r.status_code == 200
        assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"


@pytest.mark.parametrize(
    ("built", "repo", "tag"),
    [(BASE, "gpuclusters-base", "latest"), (PAUSE, "gpuclusters-pause", "1.34.4")],
)
def test_manifest_by_tag(registry: Registry, built: Built, repo: str, tag: str) -> None:
    url = f"/v2/{repo}/manifests/{tag}"
    head = registry.client.head(url, params=NS)
    assert head.status_code == 200
    assert head.headers["content-type"] == MANIFEST_MEDIA
    assert head.headers["docker-content-digest"] == built.manifest_digest
    assert head.headers["content-length"] == str(len(built.manifest))
    assert head.content == b""

    get = registry.client.get(url, params=NS)
    assert get.status_code == 200
    assert get.headers["content-type"] == MANIFEST_MEDIA
    assert get.headers["docker-content-digest"] == built.manifest_digest
    assert get.content == built.manifest
    assert "sha256:" + hashlib.sha256(get.content).hexdigest() == built.manifest_digest


def test_manifest_by_digest(registry: Registry) -> None:
    url = f"/v2/gpuclusters-base/manifests/{BASE.manifest_digest}"
    head = registry.client.head(url, params=NS)
    assert head.status_code == 200
    assert head.headers["docker-content-digest"] == BASE.manifest_digest
    get = registry.client.get(url, params=NS)
    assert get.status_code == 200
    assert get.headers["content-type"] == MANIFEST_MEDIA
    assert get.content == BASE.manifest


def test_blobs_by_digest_are_exact(registry: Registry) -> None:
    layer = registry.client.get(f"/v2/gpuclusters-base/blobs/{BASE.layer_digest}", params=NS)
    assert layer.status_code == 200
    assert layer.content == BASE.layer
    assert layer.headers["docker-content-digest"] == BASE.layer_digest
    assert layer.headers["content-type"] == "application/octet-stream"

    config = registry.client.get(f"/v2/gpuclusters-pause/blobs/{PAUSE.config_digest}")
    assert config.status_code == 200
    assert "sha256:" + hashlib.sha256(config.content).hexdigest() == PAUSE.config_digest

    head = registry.client.head(f"/v2/gpuclusters-base/blobs/{BASE.layer_digest}")
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(BASE.layer))


def test_unknown_names_are_404_with_registry_errors(registry: Registry) -> None:
    missing_tag = registry.client.get("/v2/gpuclusters-base/manifests/nope", params=NS)
    assert missing_tag.status_code == 404
    assert _errors(missing_tag)[0]["code"] == "MANIFEST_UNKNOWN"

    missing_repo = registry.client.get("/v2/other/manifests/latest")
    assert missing_repo.status_code == 404
    assert _errors(missing_repo)[0]["code"] == "MANIFEST_UNKNOWN"

    missing_blob = registry.client.get("/v2/gpuclusters-base/blobs/sha256:" + "0" * 64)
    assert missing_blob.status_code == 404
    assert _errors(missing_blob)[0]["code"] == "BLOB_UNKNOWN"

    # A layer's digest is a blob, not a manifest.
    not_manifest = registry.client.get(f"/v2/gpuclusters-base/manifests/{BASE.layer_digest}")
    assert not_manifest.status_code == 404
    assert _errors(not_manifest)[0]["code"] == "MANIFEST_UNKNOWN"

    bad_path = registry.client.get("/v2/_catalog")
    assert bad_path.status_code == 404
    assert _errors(bad_path)[0]["code"] == "NAME_UNKNOWN"


def test_new_archive_is_served_without_restart(registry: Registry) -> None:
    url = "/v2/team/tool/manifests/v1"
    assert registry.client.get(url).status_code == 404
    _write(registry.root, EXTRA)
    r = registry.client.get(url, params=NS)
    assert r.status_code == 200
    assert r.headers["docker-content-digest"] == EXTRA.manifest_digest
    assert r.content == EXTRA.manifest
    blob = registry.client.get(f"/v2/team/tool/blobs/{EXTRA.layer_digest}")
    assert blob.content == EXTRA.layer
    # The earlier images are still there.
    assert registry.client.get("/v2/gpuclusters-base/manifests/latest").status_code == 200


def test_rewritten_archive_is_reloaded_on_mtime_change(registry: Registry) -> None:
    url = "/v2/gpuclusters-base/manifests/latest"
    assert registry.client.get(url).headers["docker-content-digest"] == BASE.manifest_digest
    rebuilt = _build(BASE.image.name, b"base, rebuilt\n")
    path = _write(registry.root, rebuilt)  # same file name, new content
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before + 10**9, before + 10**9))  # whatever the clock's granularity
    r = registry.client.get(url)
    assert r.status_code == 200
    assert r.headers["docker-content-digest"] == rebuilt.manifest_digest != BASE.manifest_digest
    assert registry.client.get(f"/v2/gpuclusters-base/blobs/{rebuilt.layer_digest}").content == (
        rebuilt.layer
    )
    # The old image's blobs went with its archive.
    assert registry.client.get(f"/v2/gpuclusters-base/blobs/{BASE.layer_digest}").status_code == (
        404
    )


def test_removed_archive_is_no_longer_served(registry: Registry) -> None:
    assert registry.client.get("/v2/gpuclusters-pause/manifests/1.34.4").status_code == 200
    (registry.root / PAUSE.image.file_name).unlink()
    assert registry.client.get("/v2/gpuclusters-pause/manifests/1.34.4").status_code == 404
    assert registry.client.get("/v2/gpuclusters-base/manifests/latest").status_code == 200


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(b"this is not a tar archive" * 100, id="not-a-tar"),
        pytest.param(_tar({"oci-layout": b"{}"}), id="no-index"),
        pytest.param(
            _tar({"index.json": b'{"manifests": []}', "blobs/sha256/" + "0" * 64: b"x"}),
            id="blob-digest-mismatch",
        ),
    ],
)
def test_corrupt_archive_is_skipped(registry: Registry, corrupt: bytes) -> None:
    (registry.root / "aaa-corrupt.tar").write_bytes(corrupt)
    _write(registry.root, EXTRA)
    for url, digest in (
        ("/v2/gpuclusters-base/manifests/latest", BASE.manifest_digest),
        ("/v2/gpuclusters-pause/manifests/1.34.4", PAUSE.manifest_digest),
        ("/v2/team/tool/manifests/v1", EXTRA.manifest_digest),
    ):
        r = registry.client.get(url, params=NS)
        assert r.status_code == 200, url
        assert r.headers["docker-content-digest"] == digest
    assert set(registry.store.tags) == {
        "gpuclusters-base:latest",
        "gpuclusters-pause:1.34.4",
        "team/tool:v1",
    }


def test_store_without_a_directory_is_empty(tmp_path: Path) -> None:
    store = Store(tmp_path / "absent")
    assert store.manifest("gpuclusters-base", "latest") is None
    assert store.blob(BASE.layer_digest) is None
