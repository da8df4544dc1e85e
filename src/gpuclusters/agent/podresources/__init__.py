"""kubelet's pod-resources API (v1), which the node agent calls to learn
which pod's container holds which GPU (the metrics' ``namespace``, ``pod``
and ``container`` labels, as dcgm-exporter gets them). ``api.proto`` is
upstream's (k8s.io/kubelet v0.34.4); ``api_pb2*.py`` are generated from it
by ``scripts/gen-deviceplugin-proto`` (never edit them by hand)."""
