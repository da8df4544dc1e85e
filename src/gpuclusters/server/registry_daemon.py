"""The image registry process: CNCF Distribution, run and kept by the server.

Users push their images to ``<gateway_host>:<registry_port>/<project>/...``
and every cluster's nodes pull from there (docs/kubernetes.md "Images").
The registry is the Distribution project's own server (``registry serve``,
built by ``scripts/build-k8s-addons``); the server only

* writes its configuration (``HOME/registry/config.yml``): filesystem
  storage (``registry_dir``), HTTPS with the API's TLS certificate, and
  ``token`` auth whose realm is this server's ``/v1/registry/token`` and
  whose key set is the one :mod:`security.registry_tokens` signs with;
* starts it in a session of its own (pid in ``HOME/registry/registry.pid``)
  and stops it at shutdown, as ``kept_process`` keeps any such daemon;
* pushes the project's own images (``scripts/build-images`` leaves them as
  OCI archives in ``images_cache``) into top-level repositories with
  ``skopeo copy``, skipping an image whose manifest is there already.

Nodes reach the registry and the token endpoint through the host's
firewall, which lets cluster networks in to those two ports only
(``linux/firewall.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.core.registry_access import PULL, PUSH
from gpuclusters.layers.kubernetes import images
from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR, K8S_VERSION
from gpuclusters.linux import firewall
from gpuclusters.linux.run import CommandError, run
from gpuclusters.server.kept_process import KeptProcess, KeptProcessError
from gpuclusters.server.security.registry_tokens import ISSUER, SERVICE, RegistryKeys
from gpuclusters.server.security.tls import ServerTls
from gpuclusters.server.settings import Settings

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yml"
SECRET_FILE = "http-secret"
START_TIMEOUT_S = 20.0
# How often the images cache is looked at for new archives (push_new_images).
IMAGE_WATCH_S = 10.0
# Archive names in images_cache whose repository is not their own name: the
# images every node has had since the first version keep their names
# (``localhost/gpuclusters-base:latest`` resolves through the registry).
REPOSITORY_OF = {"base": "gpuclusters-base", "pause": "gpuclusters-pause"}


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class CachedImage:
    repository: str
    tag: str
    archive: Path


def cached_images(caches: list[Path], only: list[str] | None = None) -> list[CachedImage]:
    """The OCI archives ``<name>_<tag>.tar`` in ``caches``, as repositories
    (the first directory that has an image wins)."""
    found: dict[tuple[str, str], CachedImage] = {}
    for cache in caches:
        if not cache.is_dir():
            continue
        for path in sorted(cache.glob("*_*.tar")):
            name, _, tag = path.stem.partition("_")
            repository = REPOSITORY_OF.get(name, name)
            if only is not None and name not in only and repository not in only:
                continue
            found.setdefault((repository, tag), CachedImage(repository, tag, path))
    return list(found.values())


def builtin_archives(directory: Path, k8s_bin: Path) -> Path:
    """The images every node needs (``layers/kubernetes/images.py``), as
    archives in ``directory``, for a machine whose ``images_cache`` does
    not hold them (``scripts/build-images`` not run); rewritten only when
    their content changes."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    wanted = [("base_latest.tar", images.base_image())]
    pause_binary = k8s_bin / "pause"
    if pause_binary.is_file():
        wanted.append(
            (f"pause_v{K8S_VERSION}.tar", images.pause_image(pause_binary, f"v{K8S_VERSION}"))
        )
    for file_name, image in wanted:
        path = directory / file_name
        if not path.exists() or path.read_bytes() != image.archive:
            replace_atomically(path, image.archive, mode=0o644)
    return directory


def archive_manifest_digest(archive: Path) -> str | None:
    """The digest of the (first) manifest an OCI archive's index names."""
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.name.lstrip("./") == "index.json":
                    f = tar.extractfile(member)
                    if f is None:
                        return None
                    index = json.loads(f.read())
                    manifests = index.get("manifests") or []
                    return str(manifests[0]["digest"]) if manifests else None
    except (OSError, tarfile.TarError, ValueError, KeyError):
        return None
    return None


def render_config(settings: Settings, keys: RegistryKeys, tls: ServerTls, secret: str) -> str:
    storage = settings.registry_dir or settings.home / "registry" / "storage"
    config = {
        "version": 0.1,
        "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
            "cache": {"blobdescriptor": "inmemory"},
            "redirect": {"disable": True},
        },
        "http": {
            "addr": f"{settings.tls_host}:{settings.registry_port}",
            "secret": secret,
            "tls": {"certificate": str(tls.cert_file), "key": str(tls.key_file)},
            "headers": {"X-Content-Type-Options": ["nosniff"]},
        },
        "auth": {
            "token": {
                "realm": settings.registry_token_url,
                "service": SERVICE,
                "issuer": ISSUER,
                "jwks": str(keys.jwks_file),
                "signingalgorithms": ["ES256"],
            }
        },
    }
    return yaml.safe_dump(config, sort_keys=True)


class RegistryDaemon:
    def __init__(self, settings: Settings, keys: RegistryKeys, tls: ServerTls) -> None:
        self.settings = settings
        self.keys = keys
        self.tls = tls
        self.dir = settings.home / "registry"
        self.config_file = self.dir / CONFIG_FILE
        self.process = KeptProcess(
            "registry",
            self.dir,
            [str(settings.registry_bin), "serve", str(self.config_file)],
            config_file=self.config_file,
            ready=self._serving,
            start_timeout_s=START_TIMEOUT_S,
        )

    # -- the process -----------------------------------------------------------

    def _secret(self) -> str:
        path = self.dir / SECRET_FILE
        if not path.exists():
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            replace_atomically(path, secrets.token_hex(32).encode(), mode=0o600)
        return path.read_text().strip()

    async def start(self) -> None:
        """Run the registry with the current configuration (idempotent)."""
        if not self.settings.registry_bin.is_file():
            raise RegistryError(
                f"{self.settings.registry_bin} is missing: run scripts/build-k8s-addons "
                "(or set GPUCLUSTERS_REGISTRY=off)"
            )
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        await firewall.open_node_services(self.node_ports)
        text = render_config(self.settings, self.keys, self.tls, self._secret())
        try:
            started = await self.process.start(text)
        except KeptProcessError as exc:
            raise RegistryError(f"the image registry did not start: {exc}") from exc
        pid = self.process.running_pid()
        if started:
            log.info("image registry (pid %s) serving on %s", pid, self.settings.registry_address)
        else:
            log.info("image registry already running (pid %s)", pid)

    async def _serving(self) -> bool:
        # A liveness probe on loopback: the certificate is checked by users
        # and nodes, who reach it by its public name.
        url = f"https://127.0.0.1:{self.settings.registry_port}/v2/"
        async with httpx.AsyncClient(verify=False, timeout=2.0) as http:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get(url)).status_code == 401
        return False

    @property
    def node_ports(self) -> list[int]:
        """The host's ports nodes open: the registry and its token realm."""
        return [self.settings.registry_port, self.settings.registry_token_port]

    async def stop(self) -> None:
        await firewall.close_node_services(self.node_ports)
        if await self.process.stop():
            log.info("image registry stopped")

    # -- the project's own images ----------------------------------------------

    def system_token(self, repository: str, actions: tuple[str, ...]) -> str:
        token, _ = self.keys.mint(
            subject="gpuclusters-server",
            access=[{"type": "repository", "name": repository, "actions": list(actions)}],
        )
        return token

    async def _remote_digest(self, http: httpx.AsyncClient, image: CachedImage) -> str | None:
        url = (
            f"https://127.0.0.1:{self.settings.registry_port}"
            f"/v2/{image.repository}/manifests/{image.tag}"
        )
        headers = {
            "Authorization": f"Bearer {self.system_token(image.repository, (PULL,))}",
            "Accept": ", ".join(
                [
                    "application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.oci.image.index.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json",
                    "application/vnd.docker.distribution.manifest.list.v2+json",
                ]
            ),
        }
        with contextlib.suppress(httpx.HTTPError):
            response = await http.head(url, headers=headers)
            if response.status_code == 200:
                digest: str | None = response.headers.get("docker-content-digest")
                return digest
        return None

    async def push_system_images(self) -> list[str]:
        """Push what ``images_cache`` holds and the registry lacks; the
        references pushed."""
        k8s_bin = self.settings.k8s_bin or DEFAULT_BIN_DIR
        builtin = await asyncio.to_thread(builtin_archives, self.dir / "builtin", k8s_bin)
        wanted = cached_images(
            [self.settings.images_cache, builtin], self.settings.registry_system_images
        )
        pushed: list[str] = []
        async with httpx.AsyncClient(verify=False, timeout=10.0) as http:
            for image in wanted:
                want = await asyncio.to_thread(archive_manifest_digest, image.archive)
                if want is not None and await self._remote_digest(http, image) == want:
                    continue
                ref = f"{image.repository}:{image.tag}"
                start = time.monotonic()
                with tempfile.TemporaryDirectory(prefix="gpc-skopeo-") as tmp:
                    try:
                        await run(
                            [
                                "skopeo",
                                "copy",
                                "--quiet",
                                "--dest-tls-verify=false",
                                "--dest-registry-token",
                                self.system_token(image.repository, (PULL, PUSH)),
                                f"oci-archive:{image.archive}",
                                f"docker://127.0.0.1:{self.settings.registry_port}/{ref}",
                            ],
                            timeout_s=600.0,
                            env={**os.environ, "TMPDIR": tmp},
                        )
                    except (CommandError, OSError) as exc:
                        raise RegistryError(f"pushing {ref}: {exc}") from exc
                log.info("pushed %s into the registry in %.1fs", ref, time.monotonic() - start)
                pushed.append(ref)
        return pushed

    def _cache_signature(self) -> tuple[tuple[str, int, int], ...]:
        cache = self.settings.images_cache
        try:
            archives = sorted(cache.glob("*_*.tar"))
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in archives)
        except OSError:
            return ()

    async def push_new_images(self, interval_s: float = IMAGE_WATCH_S) -> None:
        """Push images as they land in ``images_cache`` while the server runs
        (scripts/setup builds most of them in the background): a pod that
        pulls one before then backs off and gets it at kubelet's next try."""
        seen = await asyncio.to_thread(self._cache_signature)
        while True:
            await asyncio.sleep(interval_s)
            now = await asyncio.to_thread(self._cache_signature)
            if now == seen:
                continue
            try:
                pushed = await self.push_system_images()
            except RegistryError as exc:
                log.warning("registry: %s (tried again in %.0f s)", exc, interval_s)
                continue  # `seen` unchanged: the next look tries again
            if pushed:
                log.info(
                    "pushed %d new image(s) into the registry: %s", len(pushed), ", ".join(pushed)
                )
            seen = now


def ca_fingerprint_dir(ca_pem: str) -> str:
    """A short stable name for a CA (used in client-side certificate dirs)."""
    return hashlib.sha256(ca_pem.encode()).hexdigest()[:16]


@dataclass
class RegistryRuntime:
    """What the running server holds for the registry."""

    keys: RegistryKeys
    daemon: RegistryDaemon
    ca_pem: str | None  # the CA nodes verify it with (None: system trust)
