"""The Kubernetes API client's pure parts: REST paths of the objects the
layer writes, and the TLS context built from PEM bytes."""

from __future__ import annotations

import ssl

import httpx
import pytest

from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes import pki
from gpuclusters.layers.kubernetes.api import KubeAPI, collection_path, object_path


def test_paths_of_core_group_and_named_groups() -> None:
    assert collection_path("v1", "Node") == "/api/v1/nodes"
    assert collection_path("v1", "PersistentVolumeClaim") == (
        "/api/v1/namespaces/default/persistentvolumeclaims"
    )
    assert collection_path("batch/v1", "Job", "team") == "/apis/batch/v1/namespaces/team/jobs"
    assert collection_path("storage.k8s.io/v1", "StorageClass") == (
        "/apis/storage.k8s.io/v1/storageclasses"
    )


def test_every_object_the_layer_applies_has_a_path() -> None:
    objs = cfg.storage_manifests(shared_volume=True, shared_capacity_gib=1024)
    objs.append(cfg.local_pv_manifest("n1", 100))
    objs += cfg.user_bindings([("alice", True), ("bob", False)])
    paths = [object_path(o) for o in objs]
    assert f"/api/v1/persistentvolumes/{cfg.SHARED_PV}" in paths
    assert f"/api/v1/namespaces/default/persistentvolumeclaims/{cfg.SHARED_PVC}" in paths
    assert "/api/v1/persistentvolumes/local-scratch-n1" in paths
    assert all(p.startswith(("/api/v1/", "/apis/")) for p in paths)


def test_unknown_kinds_and_nameless_objects_are_refused() -> None:
    with pytest.raises(ValueError, match="no REST path"):
        object_path({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}})
    with pytest.raises(ValueError, match=r"metadata\.name"):
        object_path({"apiVersion": "v1", "kind": "Node", "metadata": {}})


def test_shared_volume_is_pre_bound_from_both_sides() -> None:
    objs = {o["kind"]: o for o in cfg.storage_manifests(shared_volume=True, shared_capacity_gib=1)}
    pv, pvc = objs["PersistentVolume"], objs["PersistentVolumeClaim"]
    assert pv["spec"]["claimRef"] == {"namespace": "default", "name": pvc["metadata"]["name"]}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]


async def test_client_loads_the_admin_pair_and_trusts_only_the_cluster_ca() -> None:
    ca = pki.new_ca("test CA")
    admin = pki.issue(ca, "gpuclusters-admin", organizations=["system:masters"], client=True)
    api = KubeAPI("https://10.0.0.2:6443", ca_pem=ca.cert, cert_pem=admin.cert, key_pem=admin.key)
    try:
        assert api.server == "https://10.0.0.2:6443"
        assert api.ca_pem == ca.cert
        # Nothing listens there: not ready, and no exception.
        api_down = KubeAPI(
            "https://127.0.0.1:9", ca_pem=ca.cert, cert_pem=admin.cert, key_pem=admin.key
        )
        assert await api_down.ready() is False
        await api_down.close()
    finally:
        await api.close()
    other = pki.new_ca("other CA")
    with pytest.raises(ssl.SSLError):
        # A key that does not match the certificate is refused at load.
        KubeAPI("https://x:6443", ca_pem=ca.cert, cert_pem=admin.cert, key_pem=other.key)


async def test_refusals_are_typed_by_status() -> None:
    from gpuclusters.layers.base import LayerError
    from gpuclusters.layers.kubernetes.api import (
        Conflict,
        Forbidden,
        Invalid,
        KubeAPIError,
        NotFound,
        ServerError,
        TooManyRequests,
        Unauthorized,
    )

    answers = {
        "/nf": (404, "NotFound"),
        "/conflict": (409, "AlreadyExists"),
        "/unauth": (401, "Unauthorized"),
        "/forbidden": (403, "Forbidden"),
        "/invalid": (422, "Invalid"),
        "/pdb": (429, "TooManyRequests"),
        "/etcd": (503, "ServiceUnavailable"),
        "/teapot": (418, ""),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        status, reason = answers.get(request.url.path, (200, ""))
        if status == 200:
            return httpx.Response(200, json={"kind": "Node", "metadata": {"name": "n"}})
        return httpx.Response(status, json={"kind": "Status", "message": "no", "reason": reason})

    ca = pki.new_ca("test CA")
    admin = pki.issue(ca, "gpuclusters-admin", organizations=["system:masters"], client=True)
    api = KubeAPI("https://k:6443", ca_pem=ca.cert, cert_pem=admin.cert, key_pem=admin.key)
    await api._http.aclose()
    api._http = httpx.AsyncClient(base_url="https://k:6443", transport=httpx.MockTransport(handler))
    try:
        expected: dict[str, type[KubeAPIError]] = {
            "/nf": NotFound,
            "/conflict": Conflict,
            "/unauth": Unauthorized,
            "/forbidden": Forbidden,
            "/invalid": Invalid,
            "/pdb": TooManyRequests,
            "/etcd": ServerError,
            "/teapot": KubeAPIError,
        }
        for path, cls in expected.items():
            with pytest.raises(cls) as caught:
                await api.get(path)
            assert type(caught.value) is cls
            assert isinstance(caught.value, LayerError)  # the reconcilers retry it
            assert caught.value.status == answers[path][0]
            assert caught.value.reason == answers[path][1]
            assert f"HTTP {answers[path][0]}: no" in str(caught.value)
        assert (await api.get("/api/v1/nodes/n"))["metadata"]["name"] == "n"
        with pytest.raises(TooManyRequests):  # an eviction a PodDisruptionBudget refuses
            await api.create("/pdb", {"kind": "Eviction"})
        await api.delete("/nf")  # gone already: fine by default
        with pytest.raises(NotFound):
            await api.delete("/nf", missing_ok=False)
        with pytest.raises(Conflict):
            await api.merge_patch("/conflict", {})
    finally:
        await api.close()
