"""``Client``: the typed SDK entry point.

One :class:`Client` holds one httpx connection pool, the API key and the
current project. Resource groups hang off it as attributes and share its
session, so changing ``client.project`` retargets every project-scoped call::

    from gpuclusters.client import Client
    from gpuclusters.core.models import ClusterCreate

    with Client.from_config() as client:          # file < env < arguments
        client.clusters.create(ClusterCreate(name="train", cluster_type="slurm", num_gpus=16))
        cluster = client.clusters.wait("train")   # ready, or ClusterFailedError

Every call returns models from :mod:`gpuclusters.core.models` and raises the
domain errors of :mod:`gpuclusters.core.errors` (plus the client-side ones in
:mod:`gpuclusters.client.errors`). Pass ``transport=httpx.MockTransport(...)``
to test code against canned answers.

https URLs are verified against ``ca_file`` (the argument, else
``$GPUCLUSTERS_CA_FILE``, else ``ca_file`` in config.toml, which ``gpuclusters
login`` writes), or the system's trust store when none is set.
:func:`fetch_ca_certificate` gets a server's CA for a first login, checked
against the SHA-256 fingerprint its operator handed out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from gpuclusters.client._session import Session, UntrustedServerError, make_http
from gpuclusters.client.audit import AuditAPI
from gpuclusters.client.auth import AuthAPI
from gpuclusters.client.clusters import ClustersAPI
from gpuclusters.client.config import ClientConfig
from gpuclusters.client.errors import UnexpectedResponseError
from gpuclusters.client.health import AlertsAPI, HealthAPI, RepairsAPI
from gpuclusters.client.metrics import MetricsAPI
from gpuclusters.client.nodes import EventsAPI, NodesAPI, UsageAPI
from gpuclusters.client.org import (
    ApiKeysAPI,
    CapacityAPI,
    GpuTypesAPI,
    HostsAPI,
    ProjectsAPI,
    RegionsAPI,
    UsersAPI,
)
from gpuclusters.client.ssh_keys import SshKeysAPI
from gpuclusters.client.volumes import VolumesAPI
from gpuclusters.core.clientconfig import (
    DEFAULT_PROJECT,
    ClientConfigError,
    default_home,
    read_config,
)
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.models import RegistryInfo, WhoAmI

DEFAULT_TIMEOUT_S = 30.0
ENV_CA_FILE = "GPUCLUSTERS_CA_FILE"
CA_PATH = "/v1/tls/ca.pem"


class Client:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        project: str = DEFAULT_PROJECT,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
            raise ClientConfigError(
                f"server URL must look like http://host:port, got {url!r}", field="url"
            )
        self._session = Session(
            make_http(url, api_key, timeout=timeout, transport=transport, ca_file=ca_file),
            project=project,
        )
        self.clusters = ClustersAPI(self._session)
        self.nodes = NodesAPI(self._session)
        self.events = EventsAPI(self._session)
        self.usage = UsageAPI(self._session)
        self.metrics = MetricsAPI(self._session)
        self.alerts = AlertsAPI(self._session)
        self.repairs = RepairsAPI(self._session)
        self.health = HealthAPI(self._session)
        self.volumes = VolumesAPI(self._session)
        self.hosts = HostsAPI(self._session)
        self.capacity = CapacityAPI(self._session)
        self.projects = ProjectsAPI(self._session)
        self.api_keys = ApiKeysAPI(self._session)
        self.gpu_types = GpuTypesAPI(self._session)
        self.regions = RegionsAPI(self._session)
        self.ssh_keys = SshKeysAPI(self._session)
        self.users = UsersAPI(self._session)
        self.audit = AuditAPI(self._session)
        self.auth = AuthAPI(self._session)

    @classmethod
    def from_config(
        cls,
        *,
        url: str | None = None,
        api_key: str | None = None,
        project: str | None = None,
        home: Path | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | Path | None = None,
    ) -> Client:
        """A client configured from config.toml, then env, then these arguments."""
        config = ClientConfig.load(url=url, api_key=api_key, project=project, home=home)
        ca = (
            ca_file
            or os.environ.get(ENV_CA_FILE)
            or read_config(home if home is not None else default_home()).ca_file
        )
        return cls(
            config.url,
            config.api_key,
            config.project,
            timeout=timeout,
            transport=transport,
            ca_file=ca,
        )

    @property
    def url(self) -> str:
        return self._session.url

    @property
    def project(self) -> str:
        """The project that project-scoped calls (clusters, nodes, ...) address."""
        return self._session.project

    @project.setter
    def project(self, value: str) -> None:
        self._session.project = value

    def whoami(self) -> WhoAmI:
        return self._session.get("/v1/whoami", WhoAmI)

    def registry(self) -> RegistryInfo:
        """Where the image registry is (``not_found`` where none runs)."""
        return self._session.get("/v1/registry", RegistryInfo)

    def close(self) -> None:
        self._session.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(url={self.url!r}, project={self.project!r})"


def _fingerprint_bytes(value: str) -> bytes:
    """``AB:CD:...`` (as ``openssl x509 -fingerprint -sha256`` and ``gpuclusters
    up`` print it), plain hex, or either after ``SHA256:`` / ``...Fingerprint=``."""
    text = value.strip()
    text = text.split("=", 1)[1] if "=" in text else text
    text = re.sub(r"^sha-?256:", "", text.strip(), flags=re.IGNORECASE)
    digits = re.sub(r"[\s:]", "", text)
    if not re.fullmatch(r"[0-9A-Fa-f]{64}", digits):
        raise ValidationError(
            "a CA fingerprint is 32 hex pairs (SHA-256), e.g. AB:CD:...; "
            f"got {value.strip()[:80]!r}",
            field="ca_fingerprint",
        )
    return bytes.fromhex(digits)


def format_fingerprint(digest: bytes) -> str:
    return digest.hex(":").upper()


def fetch_ca_certificate(
    url: str,
    *,
    fingerprint: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """The CA certificate (PEM) a gpuclusters server hands out at
    ``/v1/tls/ca.pem``, fetched without verifying the server (nothing can
    be, yet) and returned only if its SHA-256 fingerprint is ``fingerprint``.

    Only the certificate the fingerprint covers is returned, re-encoded, so
    nothing unchecked comes along. Raises :class:`UntrustedServerError` for
    another fingerprint, ``ValidationError`` for a malformed one.
    """
    want = _fingerprint_bytes(fingerprint)
    if urlsplit(url).scheme != "https" or not urlsplit(url).netloc:
        raise ValidationError(f"a CA is only needed for an https:// URL, got {url!r}", field="url")
    http = make_http(url, None, timeout=timeout, transport=transport, verify=False)
    with http:
        response = Session(http, project=DEFAULT_PROJECT).request("GET", CA_PATH)
    try:
        cert = x509.load_pem_x509_certificate(response.content)
    except ValueError as exc:
        raise UnexpectedResponseError(f"GET {CA_PATH}: answer is not a PEM certificate") from exc
    got = cert.fingerprint(hashes.SHA256())  # over the DER bytes, as the server's
    if got != want:
        raise UntrustedServerError(
            f"the CA certificate {url.rstrip('/')} hands out has SHA-256 fingerprint "
            f"{format_fingerprint(got)}, not {format_fingerprint(want)}: this is not the "
            "server whose fingerprint you were given (or the fingerprint is mistyped)"
        )
    return cert.public_bytes(serialization.Encoding.PEM)
