"""``gpuclusters host-agent join``: turn a join token into credentials.

1. The server's CA is fetched and kept only if its SHA-256 fingerprint is
   the one ``hosts add`` handed over (or read from a file): from then on
   every call to the server is verified against it.
2. A key is made here and never leaves the host; its CSR, the token, the
   host's address and inventory go to ``POST /v1/hosts/join``.
3. The answer (certificate, control CA, heartbeat secret) and the
   configuration are written; only then is the host joined, so a failed
   join leaves nothing behind but the key.
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpuclusters.client.client import fetch_ca_certificate
from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.hostagent.config import AgentConfig
from gpuclusters.hostagent.inventory import host_inventory


class JoinError(RuntimeError):
    pass


def _key_and_csr(cfg: AgentConfig) -> tuple[bytes, str]:
    if cfg.key_file.exists():
        key_pem = cfg.key_file.read_bytes()
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise JoinError(f"{cfg.key_file} is not an EC key")
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(cfg.address))
    except ValueError:
        san = x509.DNSName(cfg.address)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cfg.name)]))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM).decode()


def join(
    cfg: AgentConfig,
    *,
    token: str,
    config_path: Path,
    ca_fingerprint: str | None = None,
    ca_file: Path | None = None,
) -> None:
    if (ca_fingerprint is None) == (ca_file is None):
        raise JoinError("give the server's CA as --ca-fingerprint or --ca-file (one of them)")
    if not cfg.server_url.startswith("https://"):
        raise JoinError(f"the server URL must be https://, got {cfg.server_url}")
    ca_pem = (
        ca_file.read_bytes()
        if ca_file is not None
        else fetch_ca_certificate(cfg.server_url, fingerprint=ca_fingerprint or "")
    )
    cfg.pki.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_pem, csr_pem = _key_and_csr(cfg)
    replace_atomically(cfg.key_file, key_pem, mode=0o600)
    body = {
        "token": token,
        "name": cfg.name,
        "address": cfg.address,
        "port": cfg.port,
        "csr_pem": csr_pem,
        "inventory": host_inventory(cfg),
    }

    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    try:
        resp = httpx.post(f"{cfg.server_url}/v1/hosts/join", json=body, verify=ctx, timeout=30)
    except httpx.HTTPError as exc:
        raise JoinError(f"cannot reach {cfg.server_url}: {exc}") from exc
    if resp.status_code != 200:
        try:
            message = resp.json().get("message", resp.text)
        except ValueError:
            message = resp.text
        raise JoinError(f"the server refused the join ({resp.status_code}): {message}")
    answer = resp.json()
    replace_atomically(cfg.server_ca_file, ca_pem, mode=0o644)
    replace_atomically(cfg.cert_file, answer["certificate_pem"].encode(), mode=0o644)
    replace_atomically(cfg.control_ca_file, answer["control_ca_pem"].encode(), mode=0o644)
    replace_atomically(cfg.secret_file, answer["secret"].encode(), mode=0o600)
    cfg.save(config_path)
