"""The Kubernetes API over HTTPS, straight from the server process.

kubectl stays the tool where its client-side logic is the point (``auth
reconcile``, cordon, drain, pod listings for preemption), but every kubectl
call starts a 60 MB Go binary inside the control-plane node (~70 ms of CPU
on these machines) and its first ``apply`` runs API discovery (~1 s). A
cluster's create polls ``/readyz``, its Nodes and the shared-volume claim
dozens of times; on two cores that CPU is taken from the apiserver being
waited for. So the hot paths talk to the API directly:

* the host reaches every control-plane node: it has the ``.1`` address on
  each cluster's bridge (``linux/network.py``), and the apiserver listens on
  all of the node's addresses;
* the apiserver's certificate is checked against the cluster's CA (it names
  the control-plane node's address), and requests authenticate with the
  admin client certificate the control-plane step issued. Both are read
  from the control-plane node; the server's database never holds them.

Writes are server-side apply (``PATCH`` with ``application/apply-patch+yaml``,
our own field manager, ``force`` so we own the fields we set), which is
idempotent like ``kubectl apply``; paths come from ``object_path``, which
knows the kinds this layer writes.

Refusals are typed by the API's status (``NotFound``, ``Conflict``,
``Forbidden``, ``Unauthorized``, ``Invalid``, ``TooManyRequests``,
``ServerError``, all ``KubeAPIError``, a ``LayerError`` the reconcilers
retry), so callers say which answers they expect (a Node that is not there
yet, an eviction a PodDisruptionBudget refuses) instead of reading status
codes, ``None`` or booleans. Transport failures are plain ``LayerError``.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from typing import Any

import httpx

from gpuclusters.layers.base import LayerError

FIELD_MANAGER = "gpuclusters"

# (apiVersion, kind) -> (resource, namespaced), for the objects this layer writes.
_RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "Event"): ("events", True),
    ("v1", "Node"): ("nodes", False),
    ("v1", "PersistentVolume"): ("persistentvolumes", False),
    ("v1", "PersistentVolumeClaim"): ("persistentvolumeclaims", True),
    ("v1", "Service"): ("services", True),
    ("apiregistration.k8s.io/v1", "APIService"): ("apiservices", False),
    ("discovery.k8s.io/v1", "EndpointSlice"): ("endpointslices", True),
    ("batch/v1", "Job"): ("jobs", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): ("clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): ("clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("storage.k8s.io/v1", "StorageClass"): ("storageclasses", False),
}


def collection_path(api_version: str, kind: str, namespace: str | None = None) -> str:
    try:
        resource, namespaced = _RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no REST path known for {api_version} {kind}") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        return f"{base}/namespaces/{namespace or 'default'}/{resource}"
    return f"{base}/{resource}"


def object_path(obj: dict[str, Any]) -> str:
    """The REST path of ``obj`` (namespaced kinds default to ``default``)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValueError(f"{obj.get('kind')} without metadata.name")
    collection = collection_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
    return f"{collection}/{name}"


class KubeAPIError(LayerError):
    """The Kubernetes API refused a request; ``status`` is its HTTP status
    and ``reason`` the Status object's reason (e.g. ``NotFound``)."""

    status = 0

    def __init__(self, message: str, *, status: int, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class NotFound(KubeAPIError):
    status = 404


class Conflict(KubeAPIError):
    """409: already exists, or a write on a stale resourceVersion."""

    status = 409


class Unauthorized(KubeAPIError):
    status = 401


class Forbidden(KubeAPIError):
    status = 403


class Invalid(KubeAPIError):
    status = 422


class TooManyRequests(KubeAPIError):
    """429: throttled, or an eviction a PodDisruptionBudget does not allow now."""

    status = 429


class ServerError(KubeAPIError):
    """5xx: the apiserver (or etcd behind it) is in trouble; try again."""


_BY_STATUS: dict[int, type[KubeAPIError]] = {
    c.status: c for c in (NotFound, Conflict, Unauthorized, Forbidden, Invalid, TooManyRequests)
}


def error_for(what: str, r: httpx.Response) -> KubeAPIError:
    """The typed error for a refused request."""
    reason = ""
    try:
        body = r.json()
        message = body.get("message") or r.text
        reason = str(body.get("reason") or "")
    except ValueError:
        message = r.text
    cls = _BY_STATUS.get(r.status_code) or (ServerError if r.status_code >= 500 else KubeAPIError)
    return cls(
        f"Kubernetes API {what}: HTTP {r.status_code}: {message[-400:]}",
        status=r.status_code,
        reason=reason,
    )


def _ssl_context(ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    # load_cert_chain reads files only; the key lives in a private temporary
    # directory for the duration of the call and is then in memory only.
    with tempfile.TemporaryDirectory(prefix="gpc-kube-") as tmp:
        cert, key = os.path.join(tmp, "tls.crt"), os.path.join(tmp, "tls.key")
        for path, data in ((cert, cert_pem), (key, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


class KubeAPI:
    """One cluster's apiserver, as its admin."""

    def __init__(
        self,
        server: str,
        *,
        ca_pem: bytes,
        cert_pem: bytes,
        key_pem: bytes,
        timeout_s: float = 20.0,
    ) -> None:
        self.server = server
        self.ca_pem = ca_pem
        self._http = httpx.AsyncClient(
            base_url=server,
            verify=_ssl_context(ca_pem, cert_pem, key_pem),
            timeout=timeout_s,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def ready(self) -> bool:
        """Whether ``/readyz`` says ok; an apiserver not listening yet is not ready."""
        try:
            r = await self._http.get("/readyz", timeout=5.0)
        except httpx.TransportError:
            return False
        return r.status_code == 200 and r.text.strip() == "ok"

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise LayerError(f"Kubernetes API {method} {path}: {exc!r}") from exc

    async def get(self, path: str) -> dict[str, Any]:
        """The object at ``path``; ``NotFound`` if there is none."""
        r = await self._request("GET", path)
        if r.status_code != 200:
            raise error_for(f"GET {path}", r)
        data: dict[str, Any] = r.json()
        return data

    async def get_node(self, name: str) -> dict[str, Any]:
        return await self.get(f"/api/v1/nodes/{name}")

    async def apply(self, objs: list[dict[str, Any]]) -> None:
        """Server-side apply of each object, in order."""
        for obj in objs:
            path = object_path(obj)
            r = await self._request(
                "PATCH",
                path,
                params={"fieldManager": FIELD_MANAGER, "force": "true"},
                content=json.dumps(obj).encode(),
                headers={"Content-Type": "application/apply-patch+yaml"},
            )
            if r.status_code not in (200, 201):
                raise error_for(f"apply {path}", r)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> None:
        r = await self._request(
            "PATCH",
            path,
            content=json.dumps(patch).encode(),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if r.status_code != 200:
            raise error_for(f"patch {path}", r)

    async def list_items(self, path: str, **params: str) -> list[dict[str, Any]]:
        r = await self._request("GET", path, params=params)
        if r.status_code != 200:
            raise error_for(f"list {path}", r)
        items: list[dict[str, Any]] = r.json().get("items", [])
        return items

    async def pods_on(self, node: str) -> list[dict[str, Any]]:
        """Every pod bound to ``node``, in all namespaces."""
        return await self.list_items("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body``; the object made (or the Status an action such as
        an eviction answers). Refusals raise their typed error."""
        r = await self._request("POST", path, content=json.dumps(body).encode())
        if r.status_code not in (200, 201, 202):
            raise error_for(f"POST {path}", r)
        data: dict[str, Any] = r.json()
        return data

    async def delete(
        self, path: str, body: dict[str, Any] | None = None, *, missing_ok: bool = True
    ) -> None:
        """DELETE; an object already gone is fine unless ``missing_ok`` is
        False (then ``NotFound``)."""
        content = json.dumps(body).encode() if body is not None else None
        r = await self._request("DELETE", path, content=content)
        if r.status_code == 404 and missing_ok:
            return
        if r.status_code not in (200, 202):
            raise error_for(f"delete {path}", r)
