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
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from gpuclusters.client._session import Session, make_http
from gpuclusters.client.clusters import ClustersAPI
from gpuclusters.client.config import ClientConfig
from gpuclusters.client.health import AlertsAPI, HealthAPI, RepairsAPI
from gpuclusters.client.nodes import EventsAPI, NodesAPI, UsageAPI
from gpuclusters.client.org import (
    ApiKeysAPI,
    CapacityAPI,
    GpuTypesAPI,
    HostsAPI,
    ProjectsAPI,
    RegionsAPI,
)
from gpuclusters.client.volumes import VolumesAPI
from gpuclusters.core.clientconfig import DEFAULT_PROJECT, ClientConfigError
from gpuclusters.core.models import WhoAmI

DEFAULT_TIMEOUT_S = 30.0


class Client:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        project: str = DEFAULT_PROJECT,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
            raise ClientConfigError(
                f"server URL must look like http://host:port, got {url!r}", field="url"
            )
        self._session = Session(
            make_http(url, api_key, timeout=timeout, transport=transport), project=project
        )
        self.clusters = ClustersAPI(self._session)
        self.nodes = NodesAPI(self._session)
        self.events = EventsAPI(self._session)
        self.usage = UsageAPI(self._session)
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
    ) -> Client:
        """A client configured from config.toml, then env, then these arguments."""
        config = ClientConfig.load(url=url, api_key=api_key, project=project, home=home)
        return cls(config.url, config.api_key, config.project, timeout=timeout, transport=transport)

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
