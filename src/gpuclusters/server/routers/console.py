"""The web console: server-rendered pages under ``/`` (the API stays under
``/v1``), same process, port and TLS as the API.

Design: Jinja2 templates (``server/console/templates``) over the very
services the API routers call, with the signed-in session's principal, so
the console shows and allows exactly what the API would for that key
(services/console.py has the sessions and CSRF). htmx (vendored under
``/console/static``) makes the live parts: an element with
``hx-get`` and ``hx-trigger="every 2s"`` asks the same URL again with an
``HX-Request`` header, and the route answers with the page's fragment only
(``partial``), so an in-progress cluster or node updates without a reload.
Errors become pages, not JSON: a missing or expired session redirects to
``/login``; a service's validation error is shown beside the form, in the
API's own words.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import pydantic
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from gpuclusters import __version__
from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import (
    AuthenticationError,
    ConflictError,
    GpuClustersError,
    InvalidStateError,
    NotFoundError,
    UnavailableError,
    ValidationError,
)
from gpuclusters.core.health.catalog import ACTIVE_CHECKS
from gpuclusters.core.quotas import WHAT
from gpuclusters.server.audit_log import remember_principal
from gpuclusters.server.deps import RuntimeDep, SessionDep
from gpuclusters.server.errors import validation_error
from gpuclusters.server.services import (
    budgets,
    capacity,
    catalog,
    clusters,
    credentials,
    gpu_charts,
    health,
    nodes,
    quotas,
    sso,
    tenancy,
    usage,
)
from gpuclusters.server.services import console as sessions
from gpuclusters.server.services.console import SignedIn

ASSETS = Path(__file__).resolve().parent.parent / "console"
STATIC_DIR = ASSETS / "static"
COOKIE = "gpc_console"
# How much of a long list a page shows: the overview's recent events, a
# cluster's or node's events, and the hosts per fleet page (the rest are a
# "next" link away; the API and CLI page through all of them).
RECENT_EVENTS = 20
CLUSTER_EVENTS = 30
FLEET_HOSTS = 200
OVERVIEW_CLUSTERS = 50

templates = Jinja2Templates(directory=str(ASSETS / "templates"))
router = APIRouter(include_in_schema=False)


class SignInRequired(Exception):
    """Raised by ``signed_in`` for a request without a live session; the app
    turns it into a redirect to the sign-in page (install)."""


async def signed_in(request: Request, session: SessionDep) -> SignedIn:
    try:
        who = await sessions.resolve(session, token=request.cookies.get(COOKIE))
    except AuthenticationError as exc:
        raise SignInRequired(str(exc)) from exc
    remember_principal(request.state, who.principal)  # for the audit log
    return who


SignedInDep = Annotated[SignedIn, Depends(signed_in)]


def install(app: Any) -> None:
    """Turn SignInRequired into a redirect to /login (htmx: a full-page
    redirect through its HX-Redirect header)."""

    async def to_login(request: Request, exc: Exception) -> Response:
        if request.headers.get("hx-request"):
            return Response(status_code=204, headers={"HX-Redirect": "/login"})
        return RedirectResponse("/login", status_code=303)

    app.add_exception_handler(SignInRequired, to_login)


def _page(
    request: Request, name: str, who: SignedIn | None, status_code: int = 200, **context: Any
) -> HTMLResponse:
    return templates.TemplateResponse(
        request,
        name,
        {
            "who": who.principal if who else None,
            "csrf": who.csrf_token if who else "",
            "version": __version__,
            "partial": bool(request.headers.get("hx-request")),
            **context,
        },
        status_code=status_code,
    )


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


# --- sign in and out ------------------------------------------------------------------------


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, rt: RuntimeDep, error: str | None = None) -> HTMLResponse:
    return _page(request, "login.html", None, error=error, sso=rt.settings.sso_issuer)


def _signed_in(request: Request, token: str, who: SignedIn) -> Response:
    """Home, with the session's cookie."""
    remember_principal(request.state, who.principal)  # for the audit log
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        max_age=int(sessions.SESSION_TTL.total_seconds()),
        httponly=True,
        secure=_secure(request),
        samesite="lax",
    )
    return response


def _sso_redirect_uri(request: Request) -> str:
    # Where the provider sends the browser back: this server as the browser
    # reached it (the provider must list it: docs/identity.md).
    return str(request.base_url).rstrip("/") + "/login/sso/callback"


@router.get("/login/sso")
async def login_sso(request: Request, session: SessionDep, rt: RuntimeDep) -> Response:
    """Sign in through the identity provider (authorization code + PKCE)."""
    try:
        url = await sso.start_console_login(session, rt, redirect_uri=_sso_redirect_uri(request))
    except (InvalidStateError, UnavailableError) as exc:
        return _page(request, "login.html", None, status_code=409, error=str(exc),
                     sso=rt.settings.sso_issuer)  # fmt: skip
    return RedirectResponse(url, status_code=303)


@router.get("/login/sso/callback")
async def login_sso_callback(
    request: Request,
    session: SessionDep,
    rt: RuntimeDep,
    state: str = "",
    code: str = "",
    error: str = "",
    error_description: str = "",
) -> Response:
    """The provider sends the browser back here with a code (or an error)."""
    if error or not code or not state:
        why = error_description or error or "the identity provider sent no code"
        return _page(request, "login.html", None, status_code=401,
                     error=f"single sign-on failed: {why}", sso=rt.settings.sso_issuer)  # fmt: skip
    try:
        signed = await sso.finish_console_login(
            session, rt, state=state, code=code, redirect_uri=_sso_redirect_uri(request)
        )
        token, who = await sessions.sign_in(session, key=signed.key)
    except (AuthenticationError, InvalidStateError, UnavailableError) as exc:
        return _page(request, "login.html", None, status_code=401, error=str(exc),
                     sso=rt.settings.sso_issuer)  # fmt: skip
    return _signed_in(request, token, who)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request, session: SessionDep, rt: RuntimeDep, api_key: Annotated[str, Form()] = ""
) -> Response:
    try:
        token, who = await sessions.sign_in(session, key=api_key)
    except AuthenticationError as exc:
        return _page(request, "login.html", None, status_code=401, error=str(exc),
                     sso=rt.settings.sso_issuer)  # fmt: skip
    return _signed_in(request, token, who)


@router.post("/logout")
async def logout(
    session: SessionDep, who: SignedInDep, csrf_token: Annotated[str, Form()] = ""
) -> Response:
    sessions.check_csrf(who, csrf_token)
    key_id = await sessions.sign_out(session, signed_in=who)
    if key_id is not None:
        await sso.sign_out(session, key_id=key_id)  # a single sign-on session ends with it
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE)
    return response


# --- pages --------------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def overview(
    request: Request,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    project: Annotated[str | None, Query(max_length=64)] = None,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> HTMLResponse:
    """Each project's first clusters (``OVERVIEW_CLUSTERS``) and the recent
    events; ``?project=P&cursor=C`` shows one project's next page, so a
    project of a thousand clusters costs one page per poll, not all of them."""
    cursor = cursor or None  # the poll URL of a project's first page has an empty one
    projects = await tenancy.list_projects(session, principal=who.principal)
    rows: list[tuple[api.Project, api.Cluster]] = []
    more: dict[str, str] = {}  # project -> cursor of its next page
    events: list[tuple[str, api.NodeEvent]] = []
    for p in projects:
        if p.role not in (ProjectRole.ADMIN, ProjectRole.EDITOR):
            continue
        if project is not None and p.name != project:
            continue
        page = await clusters.list_clusters(
            session,
            principal=who.principal,
            project_name=p.name,
            limit=OVERVIEW_CLUSTERS,
            cursor=cursor if project is not None else None,
        )
        rows.extend((p, c) for c in page.items)
        if page.next_cursor is not None:
            more[p.name] = page.next_cursor
        for e in (
            await nodes.list_events(
                session,
                principal=who.principal,
                project_name=p.name,
                cluster=None,
                node=None,
                limit=RECENT_EVENTS,
            )
        ).items:
            events.append((p.name, e))
    events.sort(key=lambda pe: pe[1].timestamp, reverse=True)
    shown = [p.name for p in projects if p.role in (ProjectRole.ADMIN, ProjectRole.EDITOR)]
    return _page(
        request,
        "overview.html",
        who,
        budget_banners=await _budget_banners(request, session, rt, who, shown),
        projects=projects,
        clusters=rows,
        more=more,
        project=project,
        # The URL the live part polls: this very page of this project.
        here="/?" + urlencode({"project": project, "cursor": cursor or ""}) if project else "/",
        events=events[:RECENT_EVENTS],
    )


async def _budget_banners(
    request: Request, session: SessionDep, rt: RuntimeDep, who: SignedIn, projects: list[str]
) -> list[str]:
    """The budget banner sits outside the part a live page polls for (every
    2 s, ``hx-select``): only a full page load pays for the spending query."""
    if request.headers.get("hx-request"):
        return []
    return await budgets.banners(session, rt=rt, principal=who.principal, projects=projects)


def _gone(request: Request, who: SignedIn, what: str) -> Response:
    """A page whose object is gone (a deleted cluster): a live page goes
    back to the overview; a fresh load says so."""
    if request.headers.get("hx-request"):
        return Response(status_code=204, headers={"HX-Redirect": "/"})
    return _page(request, "gone.html", who, status_code=404, what=what)


@router.get("/projects/{project}/clusters/{name}", response_class=HTMLResponse)
async def cluster_page(
    request: Request,
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
) -> Response:
    try:
        view = await clusters.get_cluster(
            session, principal=who.principal, project_name=project, name=name
        )
    except NotFoundError:
        return _gone(request, who, f"cluster {name}")
    events = await nodes.list_events(
        session,
        principal=who.principal,
        project_name=project,
        cluster=name,
        node=None,
        limit=CLUSTER_EVENTS,
    )
    open_alerts: dict[str, int] = {}
    for a in await health.list_alerts(
        session, principal=who.principal, project_name=project, cluster=name,
        include_resolved=False,
    ):  # fmt: skip
        open_alerts[a.node] = open_alerts.get(a.node, 0) + 1
    workloads: dict[str, list[dict[str, str]]] | None = None
    if rt.settings.metrics_query_url is not None:
        with contextlib.suppress(UnavailableError):
            workloads = await gpu_charts.workloads(
                session, rt, principal=who.principal, project=project, cluster=name
            )
    return _page(
        request,
        "cluster.html",
        who,
        budget_banners=await _budget_banners(request, session, rt, who, [project]),
        project=project,
        cluster=view,
        events=events.items,
        open_alerts=open_alerts,
        workloads=workloads,
        can_admin=_is_admin(project, await tenancy.list_projects(session, principal=who.principal)),
        error=request.query_params.get("error"),
    )


def _is_admin(project: str, projects: list[api.Project]) -> bool:
    """Whether the page shows the project admin's buttons (the services
    check the role again on every action)."""
    return any(p.name == project and p.role == ProjectRole.ADMIN for p in projects)


@router.post("/projects/{project}/clusters/{name}/scale")
async def scale_cluster(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
    num_gpus: Annotated[str, Form()] = "",
    num_preemptible_gpus: Annotated[str, Form()] = "",
) -> Response:
    sessions.check_csrf(who, csrf_token)
    fields = {"num_gpus": num_gpus, "num_preemptible_gpus": num_preemptible_gpus}

    async def scale() -> None:
        body = api.ClusterUpdate.model_validate({k: v for k, v in fields.items() if v != ""})
        await clusters.update_cluster(
            session, rt=rt, principal=who.principal, project_name=project, name=name, body=body
        )

    return await _act(scale, lambda error: _cluster_url(project, name, error))


async def _act(
    action: Callable[[], Awaitable[None]], back: Callable[[str | None], str]
) -> Response:
    """Run a form's action, then back to its page: with the reason when the
    input or the state refused it (in the API's words). Authentication and
    permission errors are not caught: they answer as the API does."""
    try:
        await action()
    except pydantic.ValidationError as exc:
        error = validation_error(RequestValidationError(exc.errors(include_url=False)))
        return RedirectResponse(back(error.message), status_code=303)
    except (ValidationError, ConflictError) as exc:
        return RedirectResponse(back(exc.message), status_code=303)
    return RedirectResponse(back(None), status_code=303)


def _cluster_url(project: str, name: str, error: str | None = None) -> str:
    query = f"?{urlencode({'error': error})}" if error else ""
    return f"/projects/{project}/clusters/{name}{query}"


@router.post("/projects/{project}/clusters/{name}/delete")
async def delete_cluster(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
    volume: Annotated[str, Form()] = "keep",
) -> Response:
    sessions.check_csrf(who, csrf_token)
    if volume not in ("keep", "delete"):
        raise ValidationError("volume: must be keep or delete", field="volume")
    await clusters.delete_cluster(
        session, rt=rt, principal=who.principal, project_name=project, name=name,
        delete_volume=volume == "delete",
    )  # fmt: skip
    return RedirectResponse(_cluster_url(project, name), status_code=303)


@router.get("/projects/{project}/nodes/{name}", response_class=HTMLResponse)
async def node_page(
    request: Request, project: str, name: str, session: SessionDep, who: SignedInDep
) -> HTMLResponse:
    p = who.principal
    node = await nodes.get_node(session, principal=p, project_name=project, name=name)
    events = await nodes.list_events(
        session, principal=p, project_name=project, cluster=None, node=name, limit=CLUSTER_EVENTS
    )
    alerts = await health.list_alerts(
        session, principal=p, project_name=project, cluster=node.cluster, include_resolved=True
    )
    repairs = await health.list_repairs(
        session, principal=p, project_name=project, cluster=node.cluster, state=None
    )
    runs = await health.list_health_runs(
        session, principal=p, project_name=project, cluster=node.cluster
    )
    projects = await tenancy.list_projects(session, principal=p)
    return _page(
        request,
        "node.html",
        who,
        project=project,
        node=node,
        events=events.items,
        alerts=[a for a in alerts if a.node == name][:30],
        repairs=[r for r in repairs if r.node == name][:20],
        runs=[r for r in runs if r.node == name][:20],
        checks=ACTIVE_CHECKS,
        can_admin=_is_admin(project, projects),
        error=request.query_params.get("error"),
    )


@router.get("/projects/{project}/nodes/{name}/telemetry")
async def node_telemetry(
    project: str, name: str, session: SessionDep, who: SignedInDep, rt: RuntimeDep
) -> dict[str, Any]:
    """The node's GPUs over the last 30 minutes for its charts (uPlot's
    columns): from the metrics database where there is one, else from the
    heartbeats this replica has seen."""
    if rt.settings.metrics_query_url is not None:
        node = await nodes.get_node(session, principal=who.principal, project_name=project,
                                    name=name)  # fmt: skip
        with contextlib.suppress(UnavailableError):
            return await gpu_charts.node_chart(
                session, rt, principal=who.principal, project=project, cluster=node.cluster,
                node=name,
            )  # fmt: skip
    return await nodes.telemetry(
        session, rt=rt, principal=who.principal, project_name=project, name=name
    )


@router.get("/projects/{project}/clusters/{name}/telemetry")
async def cluster_telemetry(
    project: str, name: str, session: SessionDep, who: SignedInDep, rt: RuntimeDep
) -> dict[str, Any]:
    """The cluster's nodes (each node's GPUs' mean) over the last hour."""
    return await gpu_charts.cluster_chart(
        session, rt, principal=who.principal, project=project, cluster=name
    )


@router.get("/projects/{project}/clusters/{name}/workloads/telemetry")
async def workload_telemetry(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    job: Annotated[str | None, Query(description="a Slurm job id")] = None,
    pod: Annotated[str | None, Query(description="NAMESPACE/NAME")] = None,
) -> dict[str, Any]:
    """A Slurm job's or pod's GPUs over its lifetime."""
    return await gpu_charts.workload_chart(
        session, rt, principal=who.principal, project=project, cluster=name, job=job, pod=pod
    )


@router.get("/projects/{project}/clusters/{name}/workloads", response_class=HTMLResponse)
async def workload_page(
    request: Request,
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    job: Annotated[str | None, Query()] = None,
    pod: Annotated[str | None, Query()] = None,
) -> HTMLResponse:
    """A job view: the GPU utilisation, memory and power of exactly the GPUs
    a Slurm job (``?job=ID``) or pod (``?pod=NAMESPACE/NAME``) ran on."""
    view = await clusters.get_cluster(
        session, principal=who.principal, project_name=project, name=name
    )
    if (job is None) == (pod is None):
        raise ValidationError("job: give one of job (a Slurm job id) or pod (NAMESPACE/NAME)",
                              field="job")  # fmt: skip
    query = urlencode({"job": job} if job is not None else {"pod": pod})
    return _page(
        request,
        "workload.html",
        who,
        project=project,
        cluster=view,
        job=job,
        pod=pod,
        data_url=f"/projects/{project}/clusters/{name}/workloads/telemetry?{query}",
    )


def _node_url(project: str, node: str, error: str | None = None) -> str:
    query = f"?{urlencode({'error': error})}" if error else ""
    return f"/projects/{project}/nodes/{node}{query}"


@router.post("/projects/{project}/nodes/{name}/health-checks")
async def run_health_check(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
    check: Annotated[str, Form()] = "",
    duration_s: Annotated[str, Form()] = "10",
) -> Response:
    sessions.check_csrf(who, csrf_token)
    node = await nodes.get_node(session, principal=who.principal, project_name=project, name=name)

    async def run() -> None:
        body = api.HealthRunCreate.model_validate(
            {"check": check, "node": name, "duration_s": duration_s}
        )
        await health.run_checks(
            session, rt=rt, principal=who.principal, project_name=project,
            cluster_name=node.cluster, body=body,
        )  # fmt: skip

    return await _act(run, lambda error: _node_url(project, name, error))


@router.post("/projects/{project}/repairs/{repair_id}/{verdict}")
async def review_repair(
    project: str,
    repair_id: str,
    verdict: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
) -> Response:
    sessions.check_csrf(who, csrf_token)
    if verdict not in ("approve", "reject", "cancel"):
        raise ValidationError("verdict: must be approve, reject or cancel", field="verdict")
    repair = await health.review_repair(
        session, rt=rt, principal=who.principal, project_name=project, repair_id=repair_id,
        verdict=verdict,
    )  # fmt: skip
    return RedirectResponse(_node_url(project, repair.node), status_code=303)


@router.get("/projects/{project}/new-cluster", response_class=HTMLResponse)
async def new_cluster_form(request: Request, project: str, who: SignedInDep) -> HTMLResponse:
    return _page(request, "new_cluster.html", who, project=project, error=None, form={})


@router.post("/projects/{project}/new-cluster", response_class=HTMLResponse)
async def create_cluster(
    request: Request,
    project: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
    name: Annotated[str, Form()] = "",
    cluster_type: Annotated[str, Form()] = "kubernetes",
    num_gpus: Annotated[str, Form()] = "",
    gpu_type: Annotated[str, Form()] = "",
    num_preemptible_gpus: Annotated[str, Form()] = "",
    volume_size_tib: Annotated[str, Form()] = "",
) -> Response:
    sessions.check_csrf(who, csrf_token)
    form = {
        "name": name,
        "cluster_type": cluster_type,
        "num_gpus": num_gpus,
        "gpu_type": gpu_type,
        "num_preemptible_gpus": num_preemptible_gpus,
        "volume_size_tib": volume_size_tib,
    }
    try:
        # The API's own model validates: the same rules and messages.
        body = api.ClusterCreate.model_validate(
            {k: v for k, v in form.items() if v not in ("", None)}
        )
        await clusters.create_cluster(
            session, rt=rt, principal=who.principal, project_name=project, body=body
        )
    except GpuClustersError as exc:
        return _page(request, "new_cluster.html", who, status_code=422, project=project,
                     error=exc.to_dict(), form=form)  # fmt: skip
    except pydantic.ValidationError as exc:
        # Worded as the API words a bad request body.
        error = validation_error(RequestValidationError(exc.errors(include_url=False))).to_dict()
        return _page(request, "new_cluster.html", who, status_code=422, project=project,
                     error=error, form=form)  # fmt: skip
    return RedirectResponse(_cluster_url(project, name), status_code=303)


@router.post("/projects/{project}/clusters/{name}/configure")
async def configure_cluster(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
    repair_automatic: Annotated[str, Form()] = "",
    repair_max_wait_s: Annotated[str, Form()] = "",
    prolog: Annotated[str | None, Form()] = None,
    epilog: Annotated[str | None, Form()] = None,
) -> Response:
    """The repair policy, and a Slurm cluster's prolog and epilog (the
    rest of its Slurm settings are kept as they are)."""
    sessions.check_csrf(who, csrf_token)
    current = await clusters.get_cluster(
        session, principal=who.principal, project_name=project, name=name
    )
    repair = current.repair or api.RepairSettings()
    update: dict[str, Any] = {
        "repair": {
            **repair.model_dump(),
            "automatic": [k.strip() for k in repair_automatic.split(",") if k.strip()],
            "max_wait_s": repair_max_wait_s or repair.max_wait_s,
        }
    }
    if current.slurm is not None:
        # Browsers send CRLF line ends; scripts run with LF.
        update["slurm"] = {
            **current.slurm.model_dump(),
            "prolog": (prolog or "").replace("\r\n", "\n") or None,
            "epilog": (epilog or "").replace("\r\n", "\n") or None,
        }

    async def save() -> None:
        body = api.ClusterUpdate.model_validate(update)
        await clusters.update_cluster(
            session, rt=rt, principal=who.principal, project_name=project, name=name, body=body
        )

    return await _act(save, lambda error: _cluster_url(project, name, error))


@router.post("/projects/{project}/clusters/{name}/kubeconfig")
async def download_kubeconfig(
    project: str,
    name: str,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    csrf_token: Annotated[str, Form()] = "",
) -> Response:
    """A kubeconfig for the signed-in user, as ``gpuclusters clusters
    credentials`` writes it (a POST: it makes the user's RBAC binding, or
    issues a client certificate where the server signs no tokens). Its exec
    plugin runs ``gpuclusters`` from the PATH: the CLI logged in as this user."""
    sessions.check_csrf(who, csrf_token)
    creds = await credentials.cluster_credentials(
        session, rt=rt, principal=who.principal, project_name=project, cluster_name=name,
        context_name=None,
    )  # fmt: skip
    return Response(
        creds.kubeconfig,
        media_type="application/yaml",
        headers={"Content-Disposition": f'attachment; filename="{name}.kubeconfig"'},
    )


@router.get("/fleet", response_class=HTMLResponse)
async def fleet_page(
    request: Request,
    session: SessionDep,
    who: SignedInDep,
    rt: RuntimeDep,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> HTMLResponse:
    """Hosts (a page of them), capacity windows and usage per project
    (organization admins; the services refuse anyone else)."""
    p = who.principal
    hosts = await catalog.list_hosts(session, principal=p, limit=FLEET_HOSTS, cursor=cursor)
    windows = await capacity.list_capacity(session, principal=p, project=None)
    projects = await tenancy.list_projects(session, principal=p)
    reports = [
        await usage.usage_report(
            session, rt=rt, principal=p, project_name=proj.name, since=None, until=None
        )
        for proj in projects
    ]
    project_quotas = [
        await quotas.get_quota(session, principal=p, project_name=proj.name) for proj in projects
    ]
    return _page(
        request,
        "fleet.html",
        who,
        hosts=hosts.items,
        cursor=cursor,
        next_cursor=hosts.next_cursor,
        capacity=windows,
        reports=reports,
        quotas=project_quotas,
        quota_names=list(WHAT),
    )
