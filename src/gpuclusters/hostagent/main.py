"""``gpuclusters host-agent run``: the host agent in the foreground (systemd
runs it; unit in ``hostagent/unit.py``).

Three things in one event loop: the API for the control plane (uvicorn,
HTTPS, client certificates of the control CA required), the heartbeat to
the server (inventory every ``heartbeat_interval_s``), and the relay of the
node agents' connections. SIGTERM stops all three; nodes keep running (they
are namespaces pinned on this host) and the next start finds them in the
provider's state file, as the server's embedded fleet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gpuclusters.hostagent.api import make_app
from gpuclusters.hostagent.config import AgentConfig
from gpuclusters.hostagent.inventory import host_inventory
from gpuclusters.hostagent.relay import Relay
from gpuclusters.linux.devices import host_devices
from gpuclusters.providers.base import HostSpec
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider

log = logging.getLogger("gpuclusters.hostagent")

INVENTORY_REFRESH_S = 60.0


class _Inventory:
    """The host's inventory, collected at most once a minute (NVML and
    sysfs reads are cheap, but heartbeats come every few seconds)."""

    def __init__(self, cfg: AgentConfig) -> None:
        self._cfg = cfg
        self._data: dict[str, Any] | None = None
        self._at = 0.0

    async def get(self) -> dict[str, Any]:
        if self._data is None or time.monotonic() - self._at > INVENTORY_REFRESH_S:
            self._data = await asyncio.to_thread(host_inventory, self._cfg)
            self._at = time.monotonic()
        return self._data


def make_provider(cfg: AgentConfig, inventory: dict[str, Any]) -> NetnsNodeProvider:
    devices = host_devices()
    real = devices is not None and devices.gpu_count > 0
    gpu_type = str(inventory.get("gpu_model")) if real else cfg.simulated_gpu_type
    num_gpus = devices.gpu_count if devices is not None and real else 8
    host = HostSpec(
        name=cfg.name,
        gpu_type=gpu_type,
        region="",
        ib_island="",
        num_gpus=num_gpus,
        nvme_gib=int(inventory.get("nvme_gib") or 0),
    )
    return NetnsNodeProvider(
        NetnsProviderConfig(
            fleet=[host],
            home=Path(cfg.home),
            ns_dir=Path(cfg.ns_dir),
            gpu_backend="auto" if real else "simulated",
            volumes_dir=Path(cfg.volumes_dir) if cfg.volumes_dir else None,
            devices=devices,
            image=Path(cfg.node_image) if cfg.node_image else None,
            # A node runs in a user namespace when the server sends its
            # project's id block (docs/security.md), as the server's own do.
            userns=True,
        )
    )


def server_context(cfg: AgentConfig) -> ssl.SSLContext:
    """How the agent checks the server: its CA only."""
    return ssl.create_default_context(cadata=cfg.server_ca_file.read_text())


async def heartbeat_loop(cfg: AgentConfig, inventory: _Inventory) -> None:
    secret = cfg.secret_file.read_text().strip()
    url = f"{cfg.server_url}/v1/hosts/{cfg.name}/heartbeat"
    async with httpx.AsyncClient(verify=server_context(cfg), timeout=10) as http:
        while True:
            try:
                resp = await http.post(
                    url,
                    json={"inventory": await inventory.get()},
                    headers={"Authorization": f"Bearer {secret}"},
                )
                if resp.status_code != 204:
                    log.warning("heartbeat refused (%s): %s", resp.status_code, resp.text[:300])
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(cfg.heartbeat_interval_s)


async def serve(cfg: AgentConfig) -> None:
    inventory = _Inventory(cfg)
    # Device discovery runs nvidia-ctk or ldconfig: not on the event loop.
    provider = await asyncio.to_thread(make_provider, cfg, await inventory.get())
    app = make_app(provider, host_name=cfg.name, local_address=cfg.address, inventory=inventory.get)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.address,
            port=cfg.port,
            ssl_certfile=str(cfg.cert_file),
            ssl_keyfile=str(cfg.key_file),
            ssl_ca_certs=str(cfg.control_ca_file),
            ssl_cert_reqs=ssl.CERT_REQUIRED,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
    )
    relay = Relay(cfg.run_dir / "agent.sock", cfg.server_url, server_context(cfg))
    await relay.start()
    beats = asyncio.create_task(heartbeat_loop(cfg, inventory))
    log.info("host agent %s listening on %s:%s", cfg.name, cfg.address, cfg.port)
    try:
        await server.serve()
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beats
        await relay.close()
        await provider.close()


def run(config_path: Path) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = AgentConfig.load(config_path)
    asyncio.run(serve(cfg))
