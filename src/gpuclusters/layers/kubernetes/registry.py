"""A read-only container registry for the images a node already holds.

``python -m gpuclusters.layers.kubernetes.registry --root DIR --listen 127.0.0.1:5000``

Why: Kubernetes pulls an image whose tag is ``latest`` on every pod start
(``imagePullPolicy`` defaults to ``Always`` for it), so an imported image
alone is not enough for ``image: localhost/gpuclusters-base:latest``. Each
node's containerd mirrors the registry host ``localhost`` to this server on
the node's own loopback; it serves the OCI image-layout archives in ``DIR``
(the ones ``images`` builds and the layer writes to every node) over the
registry HTTP API (``/v2/``), read-only: manifests by tag or digest, blobs
by digest. A pull then resolves the tag and finds every blob already in
containerd's content store.

In production a real registry (or a pull-through cache) takes this place:
point containerd's registry configuration at it and nothing else changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import tarfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("gpuclusters.registry")

_PATH = re.compile(
    r"^/v2/(?P<repo>[a-z0-9._/-]+)/(?P<kind>manifests|blobs)/(?P<ref>[A-Za-z0-9._:-]+)$"
)


@dataclass
class Store:
    """Manifests (by ``repo:tag`` and by digest) and blobs from the archives."""

    root: Path
    tags: dict[str, str] = field(default_factory=dict)  # "repo:tag" -> manifest digest
    blobs: dict[str, bytes] = field(default_factory=dict)  # digest -> content
    media: dict[str, str] = field(default_factory=dict)  # manifest digest -> media type
    _stamp: tuple[tuple[str, float], ...] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> None:
        archives = sorted(self.root.glob("*.tar")) if self.root.is_dir() else []
        stamp = tuple((p.name, p.stat().st_mtime) for p in archives)
        with self._lock:
            if stamp == self._stamp:
                return
            tags: dict[str, str] = {}
            blobs: dict[str, bytes] = {}
            media: dict[str, str] = {}
            for archive in archives:
                try:
                    self._load(archive, tags, blobs, media)
                except (OSError, tarfile.TarError, ValueError, KeyError) as exc:
                    log.warning("skipping %s: %s", archive, exc)
            self.tags, self.blobs, self.media, self._stamp = tags, blobs, media, stamp

    @staticmethod
    def _load(
        archive: Path, tags: dict[str, str], blobs: dict[str, bytes], media: dict[str, str]
    ) -> None:
        with tarfile.open(archive) as tar:
            files = {}
            for member in tar.getmembers():
                if member.isfile():
                    f = tar.extractfile(member)
                    if f is not None:
                        files[member.name.lstrip("./")] = f.read()
        index = json.loads(files["index.json"])
        for name, data in files.items():
            if name.startswith("blobs/sha256/"):
                digest = "sha256:" + name.rsplit("/", 1)[1]
                if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError(f"blob {digest} does not match its content")
                blobs[digest] = data
        for desc in index.get("manifests", []):
            ref = desc.get("annotations", {}).get("io.containerd.image.name", "")
            if not ref or desc["digest"] not in blobs:
                continue
            repo_tag = ref.split("/", 1)[1] if ref.startswith("localhost/") else ref
            tags[repo_tag if ":" in repo_tag else f"{repo_tag}:latest"] = desc["digest"]
            media[desc["digest"]] = desc["mediaType"]

    def manifest(self, repo: str, ref: str) -> tuple[str, bytes, str] | None:
        self.refresh()
        digest = ref if ref.startswith("sha256:") else self.tags.get(f"{repo}:{ref}")
        if digest is None or digest not in self.media:
            return None
        return digest, self.blobs[digest], self.media[digest]

    def blob(self, digest: str) -> bytes | None:
        self.refresh()
        return self.blobs.get(digest)


def handler_for(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpuclusters-registry"

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, code: str) -> None:
            body = json.dumps({"errors": [{"code": code, "message": self.path}]}).encode()
            self._send(404, body, {"Content-Type": "application/json"})

        def do_GET(self) -> None:
            # containerd adds "?ns=<registry host>" when it asks a mirror.
            path = urlsplit(self.path).path
            if path.rstrip("/") == "/v2":
                self._send(200, b"{}", {"Content-Type": "application/json"})
                return
            m = _PATH.match(path)
            if m is None:
                self._not_found("NAME_UNKNOWN")
                return
            if m["kind"] == "manifests":
                found = store.manifest(m["repo"], m["ref"])
                if found is None:
                    self._not_found("MANIFEST_UNKNOWN")
                    return
                digest, body, media = found
                self._send(200, body, {"Content-Type": media, "Docker-Content-Digest": digest})
                return
            blob = store.blob(m["ref"])
            if blob is None:
                self._not_found("BLOB_UNKNOWN")
                return
            headers = {
                "Content-Type": "application/octet-stream",
                "Docker-Content-Digest": m["ref"],
            }
            self._send(200, blob, headers)

        def do_HEAD(self) -> None:
            self.do_GET()

        def log_message(self, format: str, *args: object) -> None:
            log.info("%s %s", self.address_string(), format % args)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--listen", default="127.0.0.1:5000")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s registry %(message)s")
    host, port = args.listen.rsplit(":", 1)
    store = Store(args.root)
    store.refresh()
    server = ThreadingHTTPServer((host, int(port)), handler_for(store))
    log.info("serving %d image(s) from %s on %s", len(store.tags), args.root, args.listen)
    server.serve_forever()


if __name__ == "__main__":
    main()
