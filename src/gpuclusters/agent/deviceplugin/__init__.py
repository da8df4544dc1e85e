"""The node agent's Kubernetes device plugin: advertises the node's GPUs to
kubelet as ``nvidia.com/gpu`` over kubelet's device-plugin gRPC API
(v1beta1). ``api.proto`` is upstream's API; ``api_pb2*.py`` are generated from
it by ``scripts/gen-deviceplugin-proto`` (never edit them by hand);
``plugin.py`` is the plugin and the runner that keeps it registered."""

from gpuclusters.agent.deviceplugin.plugin import (
    DEFAULT_PLUGIN_DIR,
    RESOURCE_NAME,
    DevicePluginRunner,
    GpuDevicePlugin,
)

__all__ = ["DEFAULT_PLUGIN_DIR", "RESOURCE_NAME", "DevicePluginRunner", "GpuDevicePlugin"]
