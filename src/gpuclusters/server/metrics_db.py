"""The metrics database: VictoriaMetrics single-node, run and kept by the
server as it keeps the image registry (``kept_process``).

The server writes its scrape configuration (``HOME/metrics/scrape.yml``):

* ``gpuclusters-server``: this server's ``/metrics`` on its loopback
  listener;
* ``gpuclusters-nodes``: every node agent, found through the server's HTTP
  service discovery (``GET /v1/metrics/targets``, labels from the
  database: ``project_id``, ``project``, ``cluster_id``, ``cluster``,
  ``node_id``, ``node``, ``host``, ``compute_class``, ``gpu_type``).
  Target labels win over the agent's own (``honor_labels`` is off), so a
  node cannot pass its series off as another project's. A node on a host
  with a host agent is scraped through that agent over HTTPS (the target
  says so), with the control plane's client certificate and trusting the
  hosts CA only (``HOME/hosts-pki``, ``security.hosts_pki``), as the
  server's own calls to agents do.

The rule engine (vmalert, ``metrics_rules``) evaluates the alert rules
against the database and posts what fires to the server's receiver
(``/v1/metrics/alerts/api/v2/alerts``, Alertmanager's API), which records
an event on the node, and to the operator's own Alertmanagers
(``metrics_alertmanager_urls``).

The endpoints answer a bearer token only: the scrape token, a secret in
``HOME/metrics/scrape-token`` (0600) that the database reads from there.

The database listens on ``127.0.0.1:metrics_db_port`` only: no node and no
user reaches it. Users query through the API (``/v1/metrics/query``), which
adds their projects to every selector (``services.metrics``); operators may
point their own Grafana or Prometheus at it on the server's machine, or at
the same discovery endpoint (docs/metrics.md).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from pathlib import Path

import httpx
import yaml

from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.server.kept_process import KeptProcess, KeptProcessError
from gpuclusters.server.metrics_rules import render_rules
from gpuclusters.server.security.hosts_pki import agent_client_files
from gpuclusters.server.settings import Settings

log = logging.getLogger(__name__)

SCRAPE_CONFIG = "scrape.yml"
RULES_FILE = "rules.yml"
# Where vmalert posts alerts: it appends Alertmanager's /api/v2/alerts.
ALERTS_RECEIVER_PATH = "/v1/metrics/alerts"
TOKEN_FILE = "scrape-token"
SERVER_JOB = "gpuclusters-server"
NODES_JOB = "gpuclusters-nodes"
TARGETS_PATH = "/v1/metrics/targets"


async def _healthy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=2.0) as http:
        with contextlib.suppress(httpx.HTTPError):
            return (await http.get(f"{url}/health")).status_code == 200
    return False


class MetricsDbError(RuntimeError):
    pass


def scrape_token(home: Path) -> str:
    """The scrape token (made at first use)."""
    directory = home / "metrics"
    path = directory / TOKEN_FILE
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_atomically(path, secrets.token_urlsafe(32).encode(), mode=0o600)
    return path.read_text().strip()


def _server_address(settings: Settings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "", "localhost") else settings.host
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{settings.port}"


def render_scrape_config(settings: Settings, token_file: Path) -> str:
    server = _server_address(settings)
    auth = {"type": "Bearer", "credentials_file": str(token_file)}
    # The files ``ensure_hosts_pki`` keeps (made before the database starts).
    ca, cert, key = agent_client_files(settings.home)
    agents_tls = {"ca_file": str(ca), "cert_file": str(cert), "key_file": str(key)}
    config = {
        "global": {"scrape_interval": f"{settings.metrics_scrape_interval_s}s"},
        "scrape_configs": [
            {
                "job_name": SERVER_JOB,
                "authorization": auth,
                "static_configs": [{"targets": [server]}],
            },
            {
                "job_name": NODES_JOB,
                # Used by the targets behind host agents only (https).
                "tls_config": agents_tls,
                "http_sd_configs": [
                    {
                        "url": f"http://{server}{TARGETS_PATH}",
                        "authorization": auth,
                    }
                ],
            },
        ],
    }
    return yaml.safe_dump(config, sort_keys=True)


class MetricsDb:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = settings.home / "metrics"
        self.config_file = self.dir / SCRAPE_CONFIG
        self.url = f"http://127.0.0.1:{settings.metrics_db_port}"
        self.alert_url = f"http://127.0.0.1:{settings.metrics_alert_port}"
        data = settings.metrics_db_dir or self.dir / "data"
        self.process = KeptProcess(
            "victoria-metrics",
            self.dir,
            [
                str(settings.metrics_db_bin),
                f"-storageDataPath={data}",
                f"-retentionPeriod={settings.metrics_retention}",
                f"-httpListenAddr=127.0.0.1:{settings.metrics_db_port}",
                f"-promscrape.config={self.config_file}",
                "-promscrape.config.strictParse=true",
                # New nodes are scraped within a scrape interval of appearing.
                f"-promscrape.httpSDCheckInterval={settings.metrics_scrape_interval_s}s",
                # Samples are queryable once written, not 30 s later (the
                # default allows for late pushes; we only scrape).
                "-search.latencyOffset=1s",
                "-loggerLevel=WARN",
            ],
            config_file=self.config_file,
            ready=self._ready,
        )
        token_file = self.dir / TOKEN_FILE
        notifiers = [f"http://{_server_address(settings)}{ALERTS_RECEIVER_PATH}"]
        notifiers += settings.metrics_alertmanager_urls
        self.alerting = KeptProcess(
            "vmalert",
            self.dir,
            [
                str(settings.metrics_alert_bin),
                f"-rule={self.dir / RULES_FILE}",
                f"-datasource.url={self.url}",
                # Alert state as ALERTS series in the database, restored
                # from there after a restart (no alert fires twice).
                f"-remoteWrite.url={self.url}",
                f"-remoteRead.url={self.url}",
                f"-httpListenAddr=127.0.0.1:{settings.metrics_alert_port}",
                f"-evaluationInterval={settings.metrics_scrape_interval_s}s",
                # Evaluate at now (the default looks 30 s back for late pushes).
                "-rule.evalDelay=0s",
                "-rule.resendDelay=5m",
                *(f"-notifier.url={url}" for url in notifiers),
                # The token for the server's receiver; the operator's own
                # Alertmanagers get none ("" for each).
                f"-notifier.bearerTokenFile={token_file}",
                *("-notifier.bearerTokenFile=" for _ in settings.metrics_alertmanager_urls),
                "-loggerLevel=WARN",
            ],
            config_file=self.dir / RULES_FILE,
            ready=self._alerting_ready,
        )

    async def _ready(self) -> bool:
        return await _healthy(self.url)

    async def _alerting_ready(self) -> bool:
        return await _healthy(self.alert_url)

    async def start(self) -> None:
        if not self.settings.metrics_db_bin.is_file():
            raise MetricsDbError(
                f"{self.settings.metrics_db_bin} is missing: run scripts/build-k8s-addons "
                "(or set GPUCLUSTERS_METRICS_DB=off)"
            )
        token_file = self.dir / TOKEN_FILE
        scrape_token(self.settings.home)
        rules = render_rules(
            interval_s=self.settings.metrics_scrape_interval_s,
            idle_gpu_h=self.settings.metrics_idle_gpu_h,
        )
        try:
            started = await self.process.start(render_scrape_config(self.settings, token_file))
        except KeptProcessError as exc:
            raise MetricsDbError(f"the metrics database did not start: {exc}") from exc
        if self.settings.metrics_alert_bin.is_file():
            try:
                await self.alerting.start(rules)
            except KeptProcessError as exc:
                # The history matters more than its alerts: keep the database.
                log.error("the metrics rule engine did not start: %s", exc)
        else:
            log.warning("%s is missing: no metrics alerts", self.settings.metrics_alert_bin)
        pid = self.process.running_pid()
        log.info(
            "metrics database (pid %s) %s on %s",
            pid,
            "serving" if started else "already running",
            self.url,
        )

    async def stop(self) -> None:
        await self.alerting.stop()
        if await self.process.stop():
            log.info("metrics database stopped")
