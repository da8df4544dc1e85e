"""Kubernetes node configuration rendering (layers/kubernetes/config): pod
CIDRs, kubelet / kube-proxy / containerd / CNI files, command lines, storage
and RBAC objects, the sysctl shadow script and component kubeconfigs. All
pure functions: every output is parsed back and checked field by field."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from typing import Any

import pytest
import yaml

from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.layers.base import RegistryRef
from gpuclusters.layers.kubernetes import config as cfg

SPEC = cfg.K8sSpec(cluster_name="k1", api_address="10.231.3.2", api_hostname="k1-cp")
NODE = cfg.K8sNode(
    name="k1-gpu-0",
    address="10.231.3.17",
    cgroup_root="/gpc-abc123",
    labels={"b.example/x": "2", "a.example/y": "1"},
)


# --- addresses --------------------------------------------------------------------------------


def test_pod_cidr_uses_the_node_address_host_part() -> None:
    assert cfg.pod_cidr_for("10.231.3.17") == "10.244.17.0/24"
    assert NODE.pod_cidr == "10.244.17.0/24"


def test_distinct_host_parts_give_distinct_cidrs_inside_the_cluster_cidr() -> None:
    cidrs = [
        ipaddress.IPv4Network(cfg.pod_cidr_for(f"10.231.7.{h}")) for h in (1, 2, 17, 128, 254, 255)
    ]
    assert len(set(cidrs)) == len(cidrs)
    for net in cidrs:
        assert net.prefixlen == 24
        assert net.subnet_of(cfg.CLUSTER_CIDR)
    # The network part of the node's own address does not matter.
    assert cfg.pod_cidr_for("10.231.9.17") == cfg.pod_cidr_for("10.231.3.17")


def test_api_service_ip_is_first_address_of_the_service_range() -> None:
    ip = ipaddress.IPv4Address(cfg.api_service_ip())
    assert ip == cfg.SERVICE_CIDR.network_address + 1
    assert ip in cfg.SERVICE_CIDR
    assert str(ip) == "10.96.0.1"


def test_spec_server_and_pause_image() -> None:
    assert SPEC.server == f"https://10.231.3.2:{cfg.API_PORT}"
    assert SPEC.pause_image == f"localhost/gpuclusters-pause:v{cfg.K8S_VERSION}"
    assert SPEC.bin("kubelet") == f"{SPEC.bin_dir}/kubelet"


# --- node files -------------------------------------------------------------------------------


def test_kubelet_config() -> None:
    conf = json.loads(cfg.kubelet_config(SPEC, NODE))
    assert conf["kind"] == "KubeletConfiguration"
    assert conf["address"] == NODE.address
    assert conf["cgroupDriver"] == "cgroupfs"
    assert conf["cgroupRoot"] == NODE.cgroup_root
    assert conf["failCgroupV1"] is False
    assert conf["oomScoreAdj"] == 0
    assert conf["tlsCertFile"] == f"{cfg.PKI}/kubelet.crt"
    assert conf["tlsPrivateKeyFile"] == f"{cfg.PKI}/kubelet.key"
    assert conf["authentication"]["x509"]["clientCAFile"] == f"{cfg.PKI}/ca.crt"
    assert conf["authentication"]["anonymous"]["enabled"] is False
    assert conf["containerRuntimeEndpoint"] == f"unix://{cfg.CONTAINERD_SOCK}"
    assert conf["clusterDomain"] == cfg.CLUSTER_DOMAIN


def test_kube_proxy_config() -> None:
    conf = json.loads(cfg.kube_proxy_config(SPEC, NODE))
    assert conf["kind"] == "KubeProxyConfiguration"
    assert conf["mode"] == "iptables"
    assert conf["clusterCIDR"] == str(cfg.CLUSTER_CIDR)
    assert conf["conntrack"]["maxPerCore"] == 0
    assert conf["conntrack"]["min"] == 0
    assert conf["hostnameOverride"] == NODE.name
    assert conf["clientConnection"]["kubeconfig"] == f"{cfg.ETC}/kube-proxy.conf"


_RENDER_NODE_FILES = """
import sys
from gpuclusters.layers.kubernetes import config as cfg
spec = cfg.K8sSpec(cluster_name="k1", api_address="10.231.3.2", api_hostname="k1-cp")
node = cfg.K8sNode(name="k1-gpu-0", address="10.231.3.17", cgroup_root="/gpc-abc123",
                   labels={"b.example/x": "2", "a.example/y": "1"})
sys.stdout.write(cfg.kubelet_config(spec, node) + cfg.containerd_config(spec)
                 + cfg.cni_conflist(node))
"""


def test_node_files_are_the_same_in_every_process() -> None:
    """The files a node gets are compared byte for byte on every reconcile
    (a changed file restarts its daemon), by servers whose string hashing
    differs: rendered in processes with different hash seeds (set and dict
    orders of strings can differ between them), they must not."""
    outputs = set()
    for seed in ("1", "2", "3"):
        done = subprocess.run(
            [sys.executable, "-c", _RENDER_NODE_FILES],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(done.stdout)
    here = cfg.kubelet_config(SPEC, NODE) + cfg.containerd_config(SPEC) + cfg.cni_conflist(NODE)
    assert outputs == {here}


def test_containerd_config_is_toml_with_our_settings() -> None:
    conf = tomllib.loads(cfg.containerd_config(SPEC))
    assert conf["version"] == 2
    assert conf["grpc"]["address"] == cfg.CONTAINERD_SOCK
    cri = conf["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == SPEC.pause_image
    assert cri["restrict_oom_score_adj"] is True
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert runc["options"]["SystemdCgroup"] is False
    assert cri["containerd"]["default_runtime_name"] == "runc"
    # Without a registry, nodes have only the images imported into them.
    assert "registry" not in cri


def test_containerd_config_pulls_from_the_registry_with_the_cluster_credential() -> None:
    registry = RegistryRef(
        address="203.0.113.7:5443",
        ca_pem="-----BEGIN CERTIFICATE-----\n...\n",
        user="cluster-abc",
        password='p"w',
        mirrors=(("docker.io", ("https://mirror.example:5000",)),),
    )
    spec = dataclasses.replace(SPEC, registry=registry)
    cri = tomllib.loads(cfg.containerd_config(spec))["plugins"]["io.containerd.grpc.v1.cri"]
    mirrors = cri["registry"]["mirrors"]
    # localhost/NAME (the project's own images) resolves in the registry.
    assert mirrors["localhost"]["endpoint"] == ["https://203.0.113.7:5443"]
    assert mirrors["docker.io"]["endpoint"] == ["https://mirror.example:5000"]
    conf = cri["registry"]["configs"]["203.0.113.7:5443"]
    assert conf["auth"] == {"username": "cluster-abc", "password": 'p"w'}
    assert conf["tls"]["ca_file"] == cfg.REGISTRY_CA


def test_cni_conflist() -> None:
    conf = json.loads(cfg.cni_conflist(NODE))
    bridge = conf["plugins"][0]
    assert bridge["type"] == "bridge"
    assert bridge["ipMasq"] is False
    assert bridge["ipam"]["type"] == "host-local"
    assert bridge["ipam"]["ranges"] == [[{"subnet": NODE.pod_cidr}]]
    assert [p["type"] for p in conf["plugins"]] == ["bridge", "portmap"]


def test_component_kubeconfig() -> None:
    text = cfg.component_kubeconfig(
        SPEC, user="system:kube-proxy", cert="/x/proxy.crt", key="/x/proxy.key"
    )
    # JSON, hence also YAML: both parsers read the same document.
    as_json = json.loads(text)
    assert yaml.safe_load(text) == as_json
    assert as_json["clusters"][0]["cluster"]["server"] == SPEC.server
    assert as_json["clusters"][0]["cluster"]["certificate-authority"] == f"{cfg.PKI}/ca.crt"
    assert as_json["users"] == [
        {
            "name": "system:kube-proxy",
            "user": {"client-certificate": "/x/proxy.crt", "client-key": "/x/proxy.key"},
        }
    ]
    context = as_json["contexts"][0]
    assert as_json["current-context"] == context["name"]
    assert context["context"] == {"cluster": "k1", "user": "system:kube-proxy"}


# --- command lines ----------------------------------------------------------------------------


def test_kubelet_argv_has_identity_and_sorted_labels() -> None:
    argv = cfg.kubelet_argv(SPEC, NODE)
    assert argv[0] == SPEC.bin("kubelet")
    assert f"--hostname-override={NODE.name}" in argv
    assert f"--node-ip={NODE.address}" in argv
    assert "--node-labels=a.example/y=1,b.example/x=2" in argv


def test_kubelet_argv_without_labels_has_no_label_flag() -> None:
    bare = cfg.K8sNode(name="n", address="10.231.0.5", cgroup_root="/gpc-n")
    assert not any(a.startswith("--node-labels") for a in cfg.kubelet_argv(SPEC, bare))


def test_node_labels_with_and_without_island() -> None:
    without = cfg.node_labels(compute_class="gpu-h100", gpu_type="H100", ib_island=None)
    assert without == {
        cfg.LABEL_COMPUTE_CLASS: "gpu-h100",
        cfg.LABEL_GPU_TYPE: "H100",
        cfg.LABEL_GPU_PRODUCT: "H100",
    }
    with_island = cfg.node_labels(compute_class="gpu-h100", gpu_type="H100", ib_island="isl-2")
    assert with_island == {**without, cfg.LABEL_IB_ISLAND: "isl-2"}
    # An empty island is no island.
    assert cfg.node_labels(compute_class="c", gpu_type="g", ib_island="") == {
        cfg.LABEL_COMPUTE_CLASS: "c",
        cfg.LABEL_GPU_TYPE: "g",
        cfg.LABEL_GPU_PRODUCT: "g",
    }


def test_node_labels_name_the_gpu_as_skypilot_does() -> None:
    # SkyPilot wants lowercase names its `--gpus H100:8` matches.
    def label(gpu_type: str) -> str:
        labels = cfg.node_labels(compute_class="c", gpu_type=gpu_type, ib_island=None)
        return labels[cfg.LABEL_SKYPILOT_ACCELERATOR]

    assert label("H100_SXM") == "h100"
    assert label("A100_SXM") == "a100-80gb"
    for spec in GPU_TYPES.values():
        name = spec.skypilot_accelerator
        assert name == name.lower() and name.split("-")[0].upper() in spec.name, spec


# --- cluster objects --------------------------------------------------------------------------


def _by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_storage_manifests_with_shared_volume() -> None:
    objs = cfg.storage_manifests(shared_volume=True, shared_capacity_gib=512)
    classes = {o["metadata"]["name"] for o in _by_kind(objs, "StorageClass")}
    assert classes == {cfg.LOCAL_STORAGE_CLASS, cfg.SHARED_STORAGE_CLASS}

    [pv] = _by_kind(objs, "PersistentVolume")
    assert pv["metadata"]["name"] == cfg.SHARED_PV
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["hostPath"]["path"] == "/mnt/shared"
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["storageClassName"] == cfg.SHARED_STORAGE_CLASS
    assert pv["spec"]["capacity"] == {"storage": "512Gi"}

    [pvc] = _by_kind(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == cfg.SHARED_STORAGE_CLASS
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "512Gi"


def test_storage_manifests_without_shared_volume() -> None:
    objs = cfg.storage_manifests(shared_volume=False, shared_capacity_gib=512)
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("StorageClass", cfg.LOCAL_STORAGE_CLASS)
    ]
    assert objs[0]["volumeBindingMode"] == "WaitForFirstConsumer"


def test_local_pv_manifest() -> None:
    pv = cfg.local_pv_manifest("k1-gpu-3", 100)
    assert pv["metadata"]["name"] == cfg.local_pv_name("k1-gpu-3")
    assert pv["spec"]["local"] == {"path": "/scratch"}
    assert pv["spec"]["storageClassName"] == cfg.LOCAL_STORAGE_CLASS
    assert pv["spec"]["capacity"] == {"storage": "100Gi"}
    [term] = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["k1-gpu-3"]}
    ]


def test_user_bindings() -> None:
    admin, editor = cfg.user_bindings([("alice", True), ("bob", False)])
    assert admin["kind"] == "ClusterRoleBinding"
    assert admin["roleRef"]["name"] == "cluster-admin"
    assert editor["roleRef"]["name"] == "edit"
    assert admin["metadata"]["name"] == cfg.user_binding_name("alice")
    assert editor["metadata"]["name"] == cfg.user_binding_name("bob")
    assert admin["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}
    ]
    assert editor["subjects"][0]["name"] == "bob"
    assert cfg.user_bindings([]) == []


def test_as_list_wraps_objects() -> None:
    objs = cfg.storage_manifests(shared_volume=True, shared_capacity_gib=1)
    doc = json.loads(cfg.as_list(objs))
    assert doc["kind"] == "List"
    assert doc["items"] == objs


# --- sysctl shadowing -------------------------------------------------------------------------


def test_sysctl_shadow_script_covers_every_key_and_only_binds() -> None:
    script = cfg.sysctl_shadow_script()
    for key, value in cfg.KUBELET_SYSCTLS.items():
        target = f"/proc/sys/{key}"
        shadow = f"{cfg.SYSCTL_SHADOW_DIR}/{key.replace('/', '.')}"
        assert f"mount --bind {shadow} {target}" in script
        assert f"printf '%s\\n' {value} > {shadow}" in script
    # Nothing is ever written to the kernel's own settings: every redirection
    # targets a shadow file, and every bind mount's source is one.
    for target in re.findall(r">\s*(\S+)", script):
        assert target.startswith(f"{cfg.SYSCTL_SHADOW_DIR}/"), target
    binds = re.findall(r"mount --bind (\S+) (\S+)", script)
    assert len(binds) == len(cfg.KUBELET_SYSCTLS)
    for source, target in binds:
        assert source.startswith(f"{cfg.SYSCTL_SHADOW_DIR}/")
        assert target.startswith("/proc/sys/")
    assert "sysctl" not in script.replace(cfg.SYSCTL_SHADOW_DIR, "")


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh")
def test_sysctl_shadow_script_is_valid_shell() -> None:
    result = subprocess.run(
        ["sh", "-n"],
        input=cfg.sysctl_shadow_script(),
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert result.returncode == 0, result.stderr
