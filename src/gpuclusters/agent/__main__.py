"""``python -m gpuclusters.agent``: run the node agent until SIGTERM.

Configuration comes from the environment the provider sets:
``GPUCLUSTERS_AGENT_NODE_FILE`` (the node's identity, JSON),
``GPUCLUSTERS_AGENT_SOCKET`` (the control plane's unix socket),
``GPUCLUSTERS_AGENT_TOKEN_FILE`` (default /etc/gpuclusters/agent-token) and
``GPUCLUSTERS_AGENT_INTERVAL_S`` (heartbeat period, default 5).

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
from pathlib import Path
from types import FrameType

import httpx

from gpuclusters.agent.gpus import SimulatedGpus

log = logging.getLogger("gpuclusters.agent")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    node_file = Path(os.environ.get("GPUCLUSTERS_AGENT_NODE_FILE", "/etc/gpuclusters/node.json"))
    sock = os.environ.get("GPUCLUSTERS_AGENT_SOCKET", "/run/gpuclusters/agent.sock")
    token_file = Path(
        os.environ.get("GPUCLUSTERS_AGENT_TOKEN_FILE", "/etc/gpuclusters/agent-token")
    )
    interval = float(os.environ.get("GPUCLUSTERS_AGENT_INTERVAL_S", "5"))
    node = json.loads(node_file.read_text())
    gpus = SimulatedGpus(str(node.get("gpu_type", "")))
    stop = threading.Event()

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("agent for node %s starting; control plane at %s", node.get("name"), sock)
    client = httpx.Client(
        transport=httpx.HTTPTransport(uds=sock), base_url="http://control-plane", timeout=5
    )
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
            }
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
    log.info("agent stopped")


if __name__ == "__main__":
    main()
