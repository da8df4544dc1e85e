"""``python -m gpuclusters.agent``: run the node agent until SIGTERM.

Configuration comes from the environment the provider sets:
``GPUCLUSTERS_AGENT_NODE_FILE`` (the node's identity, JSON),
``GPUCLUSTERS_AGENT_SOCKET`` (the control plane's unix socket),
``GPUCLUSTERS_AGENT_TOKEN_FILE`` (default /etc/gpuclusters/agent-token),
``GPUCLUSTERS_AGENT_INTERVAL_S`` (heartbeat period, default 5),
``GPUCLUSTERS_AGENT_DEVICE_PLUGIN`` ("0" turns the Kubernetes device plugin
off; it is on by default) and ``GPUCLUSTERS_AGENT_DEVICE_PLUGIN_DIR`` (kubelet's
device-plugin directory, default /var/lib/kubelet/device-plugins),
``GPUCLUSTERS_AGENT_METRICS_PORT`` (the Prometheus endpoint's port on the
node's address, default 9400; "0" turns it off; ``agent.exporter``).

On a node with GPUs the agent also runs the ``nvidia.com/gpu`` device plugin
(``gpuclusters.agent.deviceplugin``) in background threads. It waits for
kubelet's registration socket, so it is idle on nodes without Kubernetes, and
it never takes the agent down: it logs and retries. Where the host bound its
real GPUs into the node, node.json's ``devices`` says what (device nodes and
driver files); the plugin hands those to containers too.

Until the token file exists (the control plane writes it while the node
bootstraps) the agent waits; a failed heartbeat is logged and retried at the
next tick, never fatal: the agent must outlive control-plane restarts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx

from gpuclusters.agent.exporter import DEFAULT_PORT, AgentCollector, serve_metrics
from gpuclusters.agent.gpus import GpuBackend
from gpuclusters.agent.health import NodeWatcher
from gpuclusters.agent.nvml import detect_backend

if TYPE_CHECKING:
    from gpuclusters.agent.deviceplugin import DevicePluginRunner

log = logging.getLogger("gpuclusters.agent")


def start_device_plugin(gpus: GpuBackend, devices: object = None) -> DevicePluginRunner | None:
    """Start the Kubernetes device plugin unless it is turned off or the node
    has no GPUs. ``devices``: node.json's (None: simulated GPUs). A failure to
    start is logged, never fatal; so is a ``devices`` that cannot be read (the
    plugin then runs as for simulated GPUs)."""
    if os.environ.get("GPUCLUSTERS_AGENT_DEVICE_PLUGIN", "1") == "0":
        log.info("device plugin turned off (GPUCLUSTERS_AGENT_DEVICE_PLUGIN=0)")
        return None
    if not any(g.present for g in gpus.inventory()):
        log.info("no GPUs on this node; no device plugin")
        return None
    try:
        from gpuclusters.agent.deviceplugin import DEFAULT_PLUGIN_DIR, DevicePluginRunner
        from gpuclusters.agent.deviceplugin.plugin import NodeDevices

        node_devices = None
        if devices is not None:
            try:
                node_devices = NodeDevices.from_node_info(devices)
            except ValueError as exc:
                log.error("node.json's devices unusable (%s); containers get GPU nodes only", exc)
        plugin_dir = os.environ.get("GPUCLUSTERS_AGENT_DEVICE_PLUGIN_DIR")
        runner = DevicePluginRunner(
            gpus,
            plugin_dir=Path(plugin_dir) if plugin_dir else DEFAULT_PLUGIN_DIR,
            devices=node_devices,
        )
        runner.start()
    except Exception:
        log.exception("device plugin failed to start; the agent carries on without it")
        return None
    return runner


def start_metrics(gpus: GpuBackend, node: dict[str, Any]) -> Any:
    """Serve the node's metrics on its own address (``agent.exporter``);
    None where turned off or the node has no address. A failure to listen
    is logged, never fatal: the heartbeat matters more."""
    port = int(os.environ.get("GPUCLUSTERS_AGENT_METRICS_PORT", str(DEFAULT_PORT)))
    address = str(node.get("address") or "")
    if port == 0 or not address:
        log.info("no metrics endpoint (port %d, address %r)", port, address)
        return None
    try:
        return serve_metrics(AgentCollector(gpus, node), address, port)
    except OSError as exc:
        log.error("metrics endpoint on %s:%d failed: %s", address, port, exc)
        return None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    node_file = Path(os.environ.get("GPUCLUSTERS_AGENT_NODE_FILE", "/etc/gpuclusters/node.json"))
    sock = os.environ.get("GPUCLUSTERS_AGENT_SOCKET", "/run/gpuclusters/control/agent.sock")
    token_file = Path(
        os.environ.get("GPUCLUSTERS_AGENT_TOKEN_FILE", "/etc/gpuclusters/agent-token")
    )
    interval = float(os.environ.get("GPUCLUSTERS_AGENT_INTERVAL_S", "5"))
    node = json.loads(node_file.read_text())
    gpus = detect_backend(str(node.get("gpu_type", "")), node_id=str(node["node_id"]))
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("agent for node %s starting; control plane at %s", node.get("name"), sock)
    client = httpx.Client(
        transport=httpx.HTTPTransport(uds=sock), base_url="http://control-plane", timeout=5
    )
    plugin = start_device_plugin(gpus, node.get("devices"))
    metrics = start_metrics(gpus, node)
    watcher = NodeWatcher()
    seq = 0
    while not stop.is_set():
        try:
            token = token_file.read_text().strip()
        except FileNotFoundError:
            token = ""
        if token:
            seq += 1
            body = {
                "node_id": node["node_id"],
                "seq": seq,
                "sent_at": time.time(),
                "gpus": [g.to_dict() for g in gpus.inventory()],
                "gpu_backend": gpus.name,
            }
            try:
                found = watcher.findings(gpus.health(), expected_gpus=gpus.count)
                body["findings"] = [f.to_dict() for f in found]
            except Exception:  # a check that breaks must not stop the heartbeat
                log.exception("passive checks failed")
            try:
                body["telemetry"] = [asdict(t) for t in gpus.telemetry()]
            except Exception:  # nor may the charts' samples
                log.exception("GPU telemetry failed")
            try:
                r = client.post(
                    "/agent/v1/heartbeat", json=body, headers={"Authorization": f"Bearer {token}"}
                )
                if r.status_code >= 400:
                    log.warning("heartbeat refused: %s %s", r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)
        stop.wait(interval)
    client.close()
    if plugin is not None:
        plugin.stop()
    if metrics is not None:
        metrics.shutdown()
    log.info("agent stopped")


if __name__ == "__main__":
    main()
