"""The certificates between the server and its host agents (docs/hosts.md).

Two CAs, made at the first start in ``$GPUCLUSTERS_HOME/hosts-pki`` (keys
mode 0600), so that neither side can pose as the other:

* the **hosts CA** signs each agent's server certificate (from the CSR the
  agent sends when it joins, with its join token: the agent's key never
  leaves the host). The server trusts only this CA when it calls agents,
  and checks the agent's address against the certificate.
* the **control CA** signs the server's client certificate. Agents accept
  calls only from a client certificate of this CA (mutual TLS), so another
  host's agent certificate opens no agent.

A host that re-joins gets a new certificate and secret; the old secret stops
working at once. The old certificate stays valid for TLS until it expires
(the fingerprint of the current one is kept in the host's row, not yet
checked on connections; there is no revocation list).
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.layers.kubernetes import pki

PKI_DIR = "hosts-pki"
CLIENT_NAME = "gpuclusters-control-plane"
AGENT_CERT_DAYS = 825
# ``_pair`` names the files after the pair: "<name>.crt", "<name>.key".
HOSTS_CA_CERT = "hosts-ca.crt"
CLIENT_CERT = "client.crt"
CLIENT_KEY = "client.key"


class CsrError(ValueError):
    """A join request's CSR that cannot be signed (the message says why)."""


@dataclass(frozen=True, slots=True)
class HostsPki:
    dir: Path
    hosts_ca: pki.KeyPair
    control_ca: pki.KeyPair
    client: pki.KeyPair

    @property
    def client_cert_file(self) -> Path:
        return self.dir / CLIENT_CERT

    @property
    def client_key_file(self) -> Path:
        return self.dir / CLIENT_KEY

    @property
    def hosts_ca_file(self) -> Path:
        return self.dir / HOSTS_CA_CERT


def agent_client_files(home: Path) -> tuple[Path, Path, Path]:
    """The hosts CA, the control plane's client certificate and its key, as
    files (for a process that dials agents itself: the metrics database)."""
    d = home / PKI_DIR
    return d / HOSTS_CA_CERT, d / CLIENT_CERT, d / CLIENT_KEY


def _pair(d: Path, name: str, make: pki.KeyPair | None = None) -> pki.KeyPair | None:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    if cert.exists() and key.exists():
        return pki.KeyPair(cert=cert.read_bytes(), key=key.read_bytes())
    if make is None:
        return None
    # Key first, certificate last: a crash in between leaves no certificate,
    # and the pair is made again.
    replace_atomically(key, make.key, mode=0o600)
    replace_atomically(cert, make.cert, mode=0o644)
    return make


def ensure_hosts_pki(home: Path) -> HostsPki:
    """Load the two CAs and the server's client certificate, making what is
    missing. Idempotent; blocking (call through a thread from async code)."""
    d = home / PKI_DIR
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    hosts_ca = _pair(d, "hosts-ca") or _pair(d, "hosts-ca", pki.new_ca("gpuclusters hosts CA"))
    control_ca = _pair(d, "control-ca") or _pair(
        d, "control-ca", pki.new_ca("gpuclusters control-plane CA")
    )
    assert hosts_ca is not None and control_ca is not None
    client = _pair(d, "client") or _pair(
        d, "client", pki.issue(control_ca, CLIENT_NAME, client=True, days=3650)
    )
    assert client is not None
    return HostsPki(dir=d, hosts_ca=hosts_ca, control_ca=control_ca, client=client)


def sign_agent_csr(p: HostsPki, csr_pem: str, *, name: str, address: str) -> bytes:
    """The agent's certificate: for the CSR's key, named ``name``, valid for
    ``address`` (what the server dials) as a server and as a client."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        raise CsrError(f"not a PEM certificate request: {exc}") from exc
    if not csr.is_signature_valid:
        raise CsrError("the certificate request's signature does not verify")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CsrError("the certificate request must be for an EC key")
    try:
        ipaddress.ip_address(address)
        ips, dns = [address], []
    except ValueError:
        ips, dns = [], [address]
    return pki.issue(
        p.hosts_ca,
        name,
        dns_names=dns,
        ip_addresses=ips,
        server=True,
        client=True,
        days=AGENT_CERT_DAYS,
        public_key=key,
    ).cert


def agent_client_context(p: HostsPki) -> ssl.SSLContext:
    """What the server dials agents with: trusts the hosts CA only, shows
    the control-plane client certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=p.hosts_ca.cert.decode())
    ctx.load_cert_chain(p.client_cert_file, p.client_key_file)
    return ctx
