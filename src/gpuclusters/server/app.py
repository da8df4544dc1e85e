"""The FastAPI application factory.

The lifespan builds the ``Runtime``: migrates the database, builds the
provider and syncs the fleet, bootstraps the first admin (writing the CLI's
config file), frees leases of dead predecessors, removes orphaned provider
instances, then starts the reconcilers. On shutdown it stops them and waits
for in-flight steps, so nothing is left half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuclusters import __version__
from gpuclusters.core.clientconfig import read_config, write_config
from gpuclusters.core.models import API_VERSION
from gpuclusters.providers.registry import ProviderOptions, make_provider
from gpuclusters.providers.volumes import VolumeStore
from gpuclusters.server import errors, gc_policy, openapi
from gpuclusters.server.audit_log import AuditMiddleware
from gpuclusters.server.controllers.access import AccessSync
from gpuclusters.server.controllers.autoscaler import run_autoscaler
from gpuclusters.server.controllers.base import ControllerContext, Reconciler
from gpuclusters.server.controllers.clusters import ClusterReconciler
from gpuclusters.server.controllers.health_runs import HealthRunReconciler
from gpuclusters.server.controllers.housekeeping import collect_orphans, run_housekeeping
from gpuclusters.server.controllers.leases import make_owner, release_dead_owners
from gpuclusters.server.controllers.nodes import NodeReconciler
from gpuclusters.server.controllers.repairs import RepairReconciler
from gpuclusters.server.controllers.volumes import VolumeReconciler
from gpuclusters.server.db.engine import make_engine, make_sessionmaker
from gpuclusters.server.db.hosts import DbHostDirectory
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.statistics import keep_statistics
from gpuclusters.server.fleet_metrics import keep_fleet_metrics
from gpuclusters.server.metrics_db import MetricsDb, MetricsDbError, scrape_token
from gpuclusters.server.registry_daemon import RegistryDaemon, RegistryError, RegistryRuntime
from gpuclusters.server.routers import (
    agents,
    audit,
    auth,
    catalog,
    clusters,
    console,
    health,
    hosts,
    metrics,
    oidc,
    query_params,
    registry,
    ssh_keys,
    system,
    tls,
    volumes,
)
from gpuclusters.server.runtime import Runtime, layers_for_provider
from gpuclusters.server.security.cluster_tokens import (
    DISCOVERY_PATH,
    JWKS_PATH,
    TokenIssuer,
    ensure_signing_key,
)
from gpuclusters.server.security.hosts_pki import agent_client_context, ensure_hosts_pki
from gpuclusters.server.security.oidc import OidcClient
from gpuclusters.server.security.registry_tokens import ensure_registry_keys
from gpuclusters.server.security.tls import fingerprint, served_ca_file, server_tls
from gpuclusters.server.services import tenancy
from gpuclusters.server.services.catalog import sync_hosts
from gpuclusters.server.settings import Settings, primary_address
from gpuclusters.server.startup_lock import startup_lock

log = logging.getLogger(__name__)

REQUESTS = Counter(
    "gpuclusters_http_requests_total", "HTTP requests", ["method", "route", "status"]
)
LATENCY = Histogram("gpuclusters_http_request_seconds", "HTTP request latency", ["method", "route"])


# What the listener nodes may reach serves: the registry's token endpoint,
# and the keys apiservers check users' tokens with (security/cluster_tokens).
NODE_LISTENER_PATHS = frozenset({"/v1/registry/token", DISCOVERY_PATH, JWKS_PATH})


class MetricsMiddleware:
    """Request counts and latency by route (Prometheus). Plain ASGI rather
    than ``@app.middleware("http")``: that wraps every request in extra
    tasks and streams, a measurable share of a small request's cost."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app fails before answering

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            REQUESTS.labels(scope["method"], path, str(status)).inc()
            LATENCY.labels(scope["method"], path).observe(time.perf_counter() - start)


async def _bootstrap_config(rt: Runtime) -> None:
    """First start: create the admin and write its key; later starts only
    refresh the URL (the port may have changed) in an existing config."""
    async with rt.sessionmaker() as session:
        key = await tenancy.bootstrap(session)
    home = rt.settings.home
    if key is not None:
        path = write_config(home, url=rt.settings.public_url, api_key=key)
        log.info("created the admin user; its API key is in %s", path)
        return
    stored = read_config(home)
    if stored.api_key and stored.url != rt.settings.public_url:
        write_config(
            home,
            url=rt.settings.public_url,
            api_key=stored.api_key,
            project=stored.project or tenancy.DEFAULT_PROJECT,
        )


async def build_runtime(settings: Settings) -> Runtime:
    settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)
    engine = make_engine(settings.sqlalchemy_url, slow_query_ms=settings.slow_query_ms)
    # Replicas sharing the database and home prepare them one at a time.
    async with startup_lock(engine, settings.home):
        rt = await _prepare_runtime(settings, engine)
    rt.registry = await start_registry(settings)
    rt.metrics_scrape_token = scrape_token(settings.home)
    rt.metrics_db = await start_metrics_db(settings)
    rt.oidc = make_oidc_client(settings)
    return rt


def make_oidc_client(settings: Settings) -> OidcClient | None:
    """The identity provider's client (docs/identity.md), where configured.
    Nothing is fetched yet: a provider that is down does not stop the server
    (sign-ins answer 503 until it is back)."""
    if settings.sso_issuer is None:
        return None
    verify: ssl.SSLContext | bool = True
    if settings.sso_ca_file is not None:
        verify = ssl.create_default_context(cafile=str(settings.sso_ca_file))
    return OidcClient(
        issuer=settings.sso_issuer,
        client_id=settings.sso_client_id,
        client_secret=settings.sso_secret(),
        scopes=settings.sso_scopes,
        verify=verify,
    )


async def start_metrics_db(settings: Settings) -> MetricsDb | None:
    """Run the metrics database (docs/metrics.md). One that cannot start is
    logged, not fatal: the control plane runs without its history, and
    queries answer 503 until it is back."""
    if not settings.metrics_db_enabled:
        return None
    db = MetricsDb(settings)
    try:
        await db.start()
    except MetricsDbError as exc:
        log.error("%s", exc)
        return None
    return db


async def _prepare_runtime(settings: Settings, engine: AsyncEngine) -> Runtime:
    """Migrate, load the fleet and bootstrap (under the startup lock)."""
    await upgrade_to_head(engine)
    sessionmaker = make_sessionmaker(engine)
    hosts_pki = await asyncio.to_thread(ensure_hosts_pki, settings.home)
    provider = make_provider(
        settings.provider,
        ProviderOptions(
            home=settings.home,
            fleet_file=settings.fleet_file,
            fake_boot_delay_s=settings.fake_boot_delay_s,
            fake_fail_hosts=frozenset(settings.fake_fail_hosts),
            fake_create_delay_s=settings.fake_create_delay_s,
            host_directory=DbHostDirectory(sessionmaker),
            agent_ssl=agent_client_context(hosts_pki),
            underlay_address=settings.underlay_address or primary_address(),
            cluster_mtu=settings.cluster_mtu,
            node_share=settings.node_share,
            node_userns=settings.node_userns,
            node_image=settings.node_image,
            volumes_dir=settings.volumes_dir,
        ),
    )
    api_engine = make_engine(settings.sqlalchemy_url, slow_query_ms=settings.slow_query_ms)
    rt = Runtime(
        settings=settings,
        engine=engine,
        sessionmaker=sessionmaker,
        api_engine=api_engine,
        api_sessionmaker=make_sessionmaker(api_engine),
        provider=provider,
        volumes=VolumeStore(settings.volumes_dir or settings.home / "volumes"),
        layers=layers_for_provider(provider, k8s_bin_dir=settings.k8s_bin),
    )
    if settings.tls_enabled:
        key = await asyncio.to_thread(ensure_signing_key, settings.home)
        rt.token_issuer = TokenIssuer(key, issuer=settings.tls_url)
    async with rt.sessionmaker() as session:
        await sync_hosts(session, await provider.hosts())
    await _bootstrap_config(rt)
    return rt


async def start_registry(settings: Settings) -> RegistryRuntime | None:
    """Run the image registry and push the project's own images into it,
    before any node asks for them (docs/kubernetes.md "Images")."""
    if not settings.registry_enabled:
        return None
    tls = server_tls(settings) if settings.tls_enabled else None
    if tls is None:
        raise RegistryError("the image registry needs the API over TLS (GPUCLUSTERS_TLS)")
    keys = await asyncio.to_thread(ensure_registry_keys, settings.home)
    daemon = RegistryDaemon(settings, keys, tls)
    await daemon.start()
    pushed = await daemon.push_system_images()
    if pushed:
        log.info("pushed %d image(s) into the registry: %s", len(pushed), ", ".join(pushed))
    ca_file = served_ca_file(settings)
    ca_pem = ca_file.read_text() if ca_file is not None else None
    return RegistryRuntime(keys=keys, daemon=daemon, ca_pem=ca_pem)


def make_reconcilers(rt: Runtime) -> list[Reconciler]:
    ctx = ControllerContext(
        sessionmaker=rt.sessionmaker,
        hints=rt.hints,
        owner=make_owner(),
        lease_ttl_s=rt.settings.lease_ttl_s,
        interval_s=rt.settings.reconcile_interval_s,
        concurrency=rt.settings.controller_concurrency,
        backoff_base_s=rt.settings.retry_backoff_base_s,
        backoff_cap_s=rt.settings.retry_backoff_cap_s,
    )
    return [
        ClusterReconciler(ctx, rt),
        NodeReconciler(ctx, rt),
        VolumeReconciler(ctx, rt),
        RepairReconciler(ctx, rt),
        HealthRunReconciler(ctx, rt),
    ]


def _tls_announcement(settings: Settings) -> str:
    """The HTTPS URL and the CA users need to trust it (empty when TLS is off)."""
    if not settings.tls_enabled:
        return ""
    url = settings.tls_url
    ca_file = served_ca_file(settings)
    try:
        ca_fingerprint = fingerprint(ca_file.read_bytes()) if ca_file else None
    except (OSError, ValueError):
        ca_fingerprint = None
    if ca_file is None or ca_fingerprint is None:
        return (
            f"Users reach the API at {url} (TLS, the operator's certificate):\n"
            f"  gpuclusters login --url {url} --api-key KEY\n"
        )
    return (
        f"Users reach the API at {url} (TLS). Hand them the CA certificate {ca_file}\n"
        f"(also served at {url}/v1/tls/ca.pem), SHA-256 fingerprint\n"
        f"  {ca_fingerprint}\n"
        "and an API key (gpuclusters api-keys create); they log in with\n"
        f"  gpuclusters login --url {url} --api-key KEY --ca-fingerprint {ca_fingerprint}\n"
    )


def announcement(settings: Settings) -> str:
    """What ``gpuclusters up`` tells a new user once the server is ready."""
    home = settings.home
    env = "" if home == Settings().home else f"GPUCLUSTERS_HOME={home} "
    console_url = settings.tls_url if settings.tls_enabled else settings.public_url
    return (
        f"\ngpuclusters is up at {settings.public_url} (provider {settings.provider}).\n"
        f"{_tls_announcement(settings)}"
        f"Your admin API key and the URL are in {home / 'config.toml'}; the CLI reads them.\n"
        f"The web console: open {console_url}/ in a browser and sign in with that key.\n"
        "Next, in another terminal:\n"
        f"  {env}gpuclusters clusters create demo --type slurm --gpus 16 --wait\n"
        f"  {env}gpuclusters clusters ssh demo -- sinfo\n"
        f"  {env}gpuclusters clusters delete demo --wait\n"
        "Press Ctrl-C to stop; clusters come back at the next start.\n"
    )


def create_app(
    settings: Settings | None = None, *, announce: bool = False, tune_gc: bool = False
) -> FastAPI:
    """The app; ``tune_gc`` for the server's own process (``gc_policy``),
    not for tests that build apps in theirs."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = await build_runtime(settings)
        async with rt.sessionmaker() as session:
            freed = await release_dead_owners(session)
        if freed:
            log.info("freed %d lease(s) held by a previous server process", freed)
        await collect_orphans(rt)
        reconcilers = make_reconcilers(rt)
        for r in reconcilers:
            r.start()
        housekeeping = asyncio.create_task(run_housekeeping(rt), name="housekeeping")
        autoscaler = asyncio.create_task(run_autoscaler(rt), name="autoscaler")
        statistics = asyncio.create_task(
            keep_statistics(rt.engine, rt.settings.statistics_interval_s), name="statistics"
        )
        fleet_gauges = asyncio.create_task(keep_fleet_metrics(rt), name="fleet-metrics")
        # SSH access on nodes follows the database (providers with nodes only).
        access_sync = (
            asyncio.create_task(AccessSync(rt).run(), name="access-sync")
            if rt.node_access is not None
            else None
        )
        image_pushes = (
            asyncio.create_task(rt.registry.daemon.push_new_images(), name="image-pushes")
            if rt.registry is not None
            else None
        )
        app.state.runtime = rt
        app.state.reconcilers = reconcilers
        log.info(
            "gpuclusters %s serving on %s (provider %s)",
            __version__,
            settings.public_url,
            settings.provider,
        )
        if tune_gc:
            gc_policy.after_startup()
        if announce:
            print(announcement(settings), file=sys.stderr, flush=True)
        try:
            yield
        finally:
            background = [
                t
                for t in (
                    housekeeping,
                    autoscaler,
                    statistics,
                    fleet_gauges,
                    access_sync,
                    image_pushes,
                )
                if t is not None
            ]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await asyncio.gather(*(r.stop() for r in reconcilers))
            await rt.provider.close()
            if rt.registry is not None:
                await rt.registry.daemon.stop()
            if rt.metrics_db is not None:
                await rt.metrics_db.stop()
            if rt.oidc is not None:
                await rt.oidc.close()
            if rt.api_engine is not None:
                await rt.api_engine.dispose()
            await rt.engine.dispose()

    app = FastAPI(
        title="gpuclusters",
        version=__version__,
        description=f"Self-hostable GPU clusters. Public API version {API_VERSION}.",
        lifespan=lifespan,
        dependencies=[Depends(query_params.single_valued_query)],
    )
    errors.install(app)
    openapi.install(app)

    # Outermost last: the audit log sees the status the metrics saw.
    app.add_middleware(AuditMiddleware)
    app.add_middleware(MetricsMiddleware)

    if settings.registry_enabled:
        token_port = settings.registry_token_port

        @app.middleware("http")
        async def _token_listener_only(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            # The listener nodes may reach answers the registry's token
            # endpoint and nothing else of the API.
            server = request.scope.get("server")
            on_token_port = server is not None and server[1] == token_port
            if on_token_port and request.url.path not in NODE_LISTENER_PATHS:
                return JSONResponse(
                    status_code=404,
                    content={
                        "code": "not_found",
                        "message": "this port serves only "
                        + ", ".join(sorted(NODE_LISTENER_PATHS)),
                        "field": None,
                    },
                )
            return await call_next(request)

    # The web console under / (its own router, static files and errors).
    console.install(app)
    app.mount("/console/static", StaticFiles(directory=console.STATIC_DIR), name="console-static")
    for router in (
        console.router,
        system.router,
        metrics.router,
        catalog.router,
        clusters.router,
        volumes.router,
        health.router,
        agents.router,
        hosts.router,
        tls.router,
        registry.router,
        ssh_keys.router,
        audit.router,
        auth.router,
        oidc.router,
    ):
        app.include_router(router)
    return app
