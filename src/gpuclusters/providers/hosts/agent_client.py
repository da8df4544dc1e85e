"""The server's side of a host agent's API (``hostagent/api.py``).

HTTPS with the control-plane client certificate, the agent's certificate
checked against the hosts CA and its address. Answers become the provider
contract's errors: ``409 permanent`` -> ``PermanentProviderError``; a
``503 transient``, a timeout or an agent that cannot be reached ->
``ProviderError`` (the caller retries later; nothing is assumed about a
host it cannot reach).
"""

from __future__ import annotations

import ssl
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from gpuclusters.providers.base import PermanentProviderError, ProviderError
from gpuclusters.providers.hosts import wire

_M = TypeVar("_M", bound=BaseModel)

# Long enough for a node's boot or a slow command; commands carry their own
# timeout on top of which the HTTP call gets this much slack.
CALL_TIMEOUT_S = 120.0
RUN_SLACK_S = 15.0


class AgentClient:
    def __init__(self, *, host: str, address: str, port: int, ctx: ssl.SSLContext) -> None:
        self.host = host
        self.address = address
        self._http = httpx.AsyncClient(
            base_url=f"https://{address}:{port}", verify=ctx, timeout=CALL_TIMEOUT_S
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        try:
            resp = await self._http.request(
                method,
                path,
                json=body.model_dump() if body is not None else None,
                timeout=timeout_s if timeout_s is not None else CALL_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            raise ProviderError(f"host {self.host}: agent unreachable: {exc!r}") from exc
        if resp.status_code < 300:
            return resp
        try:
            failure = wire.Failure.model_validate(resp.json())
            message = failure.message
            permanent = failure.code == "permanent"
        except ValueError:
            message, permanent = resp.text[:500], False
        text = f"host {self.host}: {message}"
        if permanent:
            raise PermanentProviderError(text)
        raise ProviderError(text)

    async def _get(self, model: type[_M], method: str, path: str, **kw: Any) -> _M:
        resp = await self._call(method, path, **kw)
        try:
            return model.model_validate(resp.json())
        except ValueError as exc:
            raise ProviderError(f"host {self.host}: unexpected answer to {path}: {exc}") from exc

    # -- networks and nodes ----------------------------------------------------

    async def info(self) -> dict[str, Any]:
        resp = await self._call("GET", "/v1/info", timeout_s=10)
        data: dict[str, Any] = resp.json()
        return data

    async def put_segment(self, cluster_id: str, segment: wire.Segment) -> None:
        await self._call("PUT", f"/v1/networks/{cluster_id}", body=segment)

    async def delete_segment(self, cluster_id: str) -> None:
        await self._call("DELETE", f"/v1/networks/{cluster_id}")

    async def put_node(self, node_id: str, body: wire.NodeCreate) -> wire.InstanceOut:
        return await self._get(wire.InstanceOut, "PUT", f"/v1/nodes/{node_id}", body=body)

    async def node(self, node_id: str) -> wire.InstanceOut:
        return await self._get(wire.InstanceOut, "GET", f"/v1/nodes/{node_id}", timeout_s=20)

    async def nodes(self) -> list[wire.InstanceOut]:
        resp = await self._call("GET", "/v1/nodes", timeout_s=30)
        return [wire.InstanceOut.model_validate(x) for x in resp.json()]

    async def delete_node(self, node_id: str) -> None:
        await self._call("DELETE", f"/v1/nodes/{node_id}")

    async def restart(self, node_id: str, *, reprovision: bool) -> wire.InstanceOut:
        what = "reprovision" if reprovision else "reboot"
        return await self._get(wire.InstanceOut, "POST", f"/v1/nodes/{node_id}/{what}")

    # -- inside nodes ----------------------------------------------------------

    async def shell_info(self, node_id: str) -> wire.ShellInfo:
        return await self._get(wire.ShellInfo, "GET", f"/v1/nodes/{node_id}/shell", timeout_s=20)

    async def run(self, node_id: str, body: wire.Run) -> wire.RunResult:
        return await self._get(
            wire.RunResult,
            "POST",
            f"/v1/nodes/{node_id}/run",
            body=body,
            timeout_s=body.timeout_s + RUN_SLACK_S,
        )

    async def spawn(self, node_id: str, body: wire.Spawn) -> None:
        await self._call("POST", f"/v1/nodes/{node_id}/spawn", body=body)

    async def stop(self, node_id: str, body: wire.Stop) -> None:
        await self._call(
            "POST", f"/v1/nodes/{node_id}/stop", body=body, timeout_s=body.timeout_s + RUN_SLACK_S
        )

    async def is_running(self, node_id: str, name: str) -> bool:
        out = await self._get(wire.Running, "GET", f"/v1/nodes/{node_id}/daemons/{name}")
        return out.running

    async def write_file(self, node_id: str, body: wire.WriteFile) -> bool:
        out = await self._get(wire.Changed, "PUT", f"/v1/nodes/{node_id}/files", body=body)
        return out.changed

    async def read_file(self, node_id: str, path: str) -> bytes | None:
        out = await self._get(
            wire.FileData, "POST", f"/v1/nodes/{node_id}/files/read", body=wire.ReadFile(path=path)
        )
        return wire.unb64(out.data) if out.data is not None else None
