"""The host agent's API: what the control plane may ask of this host.

Served over HTTPS with client certificates required (``main.py``): only a
holder of the control CA's client certificate, i.e. the server, gets here.
Every call maps onto one idempotent method of the host's
``NetnsNodeProvider`` (nodes, their cluster segments) or of a node's
``NamespaceShell`` (commands, daemons, files), so a call the server repeats
after a crash or a lost answer does no harm. Provider errors come back as
``503 transient`` or ``409 permanent`` (``wire.Failure``) and become the
same ``ProviderError`` classes on the server's side.

``GET /v1/nodes/{node_id}/metrics`` is the way the server's metrics
database scrapes a node here: the node's address is on this host's cluster
bridge, which the server's machine does not route to, so the agent fetches
the node agent's ``/metrics`` (at the node's address from this host's own
state, never one the caller names) and passes it through unchanged. A node
agent that does not answer is a 502, which the database records as the
target being down (``NodeAgentDown``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import NodeCommandError, NodeShell
from gpuclusters.providers.base import (
    Instance,
    NodeSpec,
    PermanentProviderError,
    ProviderError,
)
from gpuclusters.providers.hosts import wire
from gpuclusters.providers.netns.provider import NetnsNodeProvider

log = logging.getLogger(__name__)

# A node agent's answer takes milliseconds; the database's own scrape
# timeout (10 s) is the outer bound.
NODE_METRICS_TIMEOUT_S = 8.0
NODE_METRICS_PORT = 9400


def _instance(i: Instance) -> wire.InstanceOut:
    return wire.InstanceOut(node_id=i.node_id, host=i.host, state=i.state.value, message=i.message)


def make_app(
    provider: NetnsNodeProvider,
    *,
    host_name: str,
    local_address: str,
    inventory: Callable[[], Awaitable[dict[str, Any]]],
) -> FastAPI:
    app = FastAPI(title="gpuclusters host agent", docs_url=None, redoc_url=None)

    @app.exception_handler(PermanentProviderError)
    async def _permanent(request: Request, exc: PermanentProviderError) -> JSONResponse:
        body = wire.Failure(code="permanent", message=str(exc))
        return JSONResponse(body.model_dump(), status_code=409)

    @app.exception_handler(ProviderError)
    async def _transient(request: Request, exc: ProviderError) -> JSONResponse:
        body = wire.Failure(code="transient", message=str(exc))
        return JSONResponse(body.model_dump(), status_code=503)

    @app.exception_handler(NodeCommandError)
    async def _command(request: Request, exc: NodeCommandError) -> JSONResponse:
        body = wire.Failure(code="transient", message=str(exc))
        return JSONResponse(body.model_dump(), status_code=503)

    @app.exception_handler(ValueError)
    async def _bad(request: Request, exc: ValueError) -> JSONResponse:
        body = wire.Failure(code="permanent", message=str(exc))
        return JSONResponse(body.model_dump(), status_code=400)

    async def shell(node_id: str) -> NodeShell:
        return await provider.shell(node_id)

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        return {"name": host_name, "address": local_address, "inventory": await inventory()}

    @app.put("/v1/networks/{cluster_id}", status_code=204)
    async def put_network(cluster_id: str, body: wire.Segment) -> Response:
        await provider.ensure_segment(
            cluster_id=cluster_id,
            index=body.index,
            vni=body.vni,
            local=local_address,
            peers=set(body.peers) - {local_address},
            mtu=body.mtu,
            names=body.names,
            egress=body.egress,
        )
        return Response(status_code=204)

    @app.delete("/v1/networks/{cluster_id}", status_code=204)
    async def delete_network(cluster_id: str) -> Response:
        await provider.forget_network(cluster_id)
        return Response(status_code=204)

    @app.get("/v1/nodes")
    async def list_nodes() -> list[wire.InstanceOut]:
        return [_instance(i) for i in await provider.list_instances()]

    @app.put("/v1/nodes/{node_id}")
    async def put_node(node_id: str, body: wire.NodeCreate) -> wire.InstanceOut:
        spec = NodeSpec(
            node_id=node_id,
            name=body.name,
            cluster_id=body.cluster_id,
            cluster_name=body.cluster_name,
            host=host_name,
            gpu_type=body.gpu_type,
            compute_class=body.compute_class,
            volume_id=body.volume_id,
            labels=body.labels,
            host_ids=None if body.host_ids_first is None else IdBlock(body.host_ids_first),
        )
        return _instance(await provider.create_at(spec, address=body.address))

    @app.get("/v1/nodes/{node_id}")
    async def get_node(node_id: str) -> wire.InstanceOut:
        return _instance(await provider.status(node_id))

    @app.delete("/v1/nodes/{node_id}", status_code=204)
    async def delete_node(node_id: str) -> Response:
        await provider.delete(node_id)
        return Response(status_code=204)

    @app.get("/v1/nodes/{node_id}/metrics")
    async def node_metrics(
        node_id: str, port: int = Query(NODE_METRICS_PORT, ge=1, le=65535)
    ) -> Response:
        address = (await shell(node_id)).address
        host = f"[{address}]" if ":" in address else address
        try:
            async with httpx.AsyncClient(timeout=NODE_METRICS_TIMEOUT_S) as http:
                got = await http.get(f"http://{host}:{port}/metrics")
        except httpx.HTTPError as exc:
            body = wire.Failure(code="transient", message=f"node agent at {host}:{port}: {exc}")
            return JSONResponse(body.model_dump(), status_code=502)
        return Response(
            content=got.content,
            status_code=got.status_code,
            media_type=got.headers.get("content-type", "text/plain"),
        )

    @app.post("/v1/nodes/{node_id}/reboot")
    async def reboot(node_id: str) -> wire.InstanceOut:
        return _instance(await provider.reboot(node_id))

    @app.post("/v1/nodes/{node_id}/reprovision")
    async def reprovision(node_id: str) -> wire.InstanceOut:
        return _instance(await provider.reprovision(node_id))

    @app.get("/v1/nodes/{node_id}/shell")
    async def shell_info(node_id: str) -> wire.ShellInfo:
        sh = await shell(node_id)
        return wire.ShellInfo(
            hostname=sh.hostname, address=sh.address, enter=sh.exec_argv([]), python=sh.python
        )

    @app.post("/v1/nodes/{node_id}/run")
    async def run(node_id: str, body: wire.Run) -> wire.RunResult:
        sh = await shell(node_id)
        done = await sh.run(
            body.argv,
            user=body.user,
            env=body.env,
            stdin=wire.unb64(body.stdin) if body.stdin is not None else None,
            timeout_s=body.timeout_s,
            check=False,
        )
        return wire.RunResult(
            returncode=done.returncode,
            stdout=wire.b64(done.stdout.encode()),
            stderr=wire.b64(done.stderr.encode()),
        )

    @app.post("/v1/nodes/{node_id}/spawn", status_code=204)
    async def spawn(node_id: str, body: wire.Spawn) -> Response:
        await (await shell(node_id)).spawn(body.name, body.argv, env=body.env)
        return Response(status_code=204)

    @app.post("/v1/nodes/{node_id}/stop", status_code=204)
    async def stop(node_id: str, body: wire.Stop) -> Response:
        await (await shell(node_id)).stop(body.name, timeout_s=body.timeout_s)
        return Response(status_code=204)

    @app.get("/v1/nodes/{node_id}/daemons/{name}")
    async def is_running(node_id: str, name: str) -> wire.Running:
        return wire.Running(running=await (await shell(node_id)).is_running(name))

    @app.put("/v1/nodes/{node_id}/files")
    async def write_file(node_id: str, body: wire.WriteFile) -> wire.Changed:
        changed = await (await shell(node_id)).write_file(
            body.path, wire.unb64(body.data), mode=body.mode, owner=body.owner
        )
        return wire.Changed(changed=changed)

    @app.post("/v1/nodes/{node_id}/files/read")
    async def read_file(node_id: str, body: wire.ReadFile) -> wire.FileData:
        data = await (await shell(node_id)).read_file(body.path)
        return wire.FileData(data=wire.b64(data) if data is not None else None)

    return app
