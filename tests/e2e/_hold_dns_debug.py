# Temporary debugging aid (not committed): holds a cluster until /tmp/dns-debug-stop exists.
import json, os, time
from test_kubernetes_dns import cluster, web, Cluster  # noqa: F401

def test_hold(cluster: Cluster) -> None:
    info = {"kubeconfig": str(cluster.kubeconfig), "cp": cluster.cp.nsenter_args(), "cp_address": cluster.cp_address, "nodes": cluster.nodes, "home": str(cluster.server.home), "log": str(cluster.server.log_path)}
    open("/tmp/dns-debug.json", "w").write(json.dumps(info))
    while not os.path.exists("/tmp/dns-debug-stop"):
        time.sleep(1)
