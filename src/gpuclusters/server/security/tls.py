"""The API's TLS material: a CA of this server's own and the server
certificate it signs, or an operator's certificate.

Without ``tls_cert_file`` the server keeps, in ``$GPUCLUSTERS_HOME/tls/``::

    ca.pem           the CA certificate users trust (0644; GET /v1/tls/ca.pem)
    ca-key.pem       its key (0600)
    server.pem       the listener's certificate, signed by the CA (0644)
    server-key.pem   its key (0600)

The CA is made once and kept for twenty years: every user who trusts it
would have to be given a new one, so it is never replaced behind the
operator's back (a CA certificate without its key is an error, not a
reason to make a new CA). The server certificate is cheap to replace and is
reissued at start whenever it no longer fits: its names differ from what
``gateway_host`` asks for, it expires within :data:`RENEW_BEFORE`, it was
not signed by the current CA, or its key is not the one on disk.

The server certificate names ``gateway_host`` (an IP SAN when it parses as
an address, a DNS SAN otherwise) plus ``localhost`` and ``127.0.0.1``, so
the same URL scheme works from users' machines and on this one.

Certificates are made by the clusters' PKI code (``layers/kubernetes/pki.py``:
ECDSA P-256, which every TLS client takes). Files are
written to a temporary file and renamed, keys before certificates, so a
crash leaves either the old pair, or a key whose certificate no longer
matches and is reissued at the next start.

Fingerprints (:func:`fingerprint`) are SHA-256 over the certificate's DER
bytes, upper-case hex pairs joined by colons, as ``openssl x509
-fingerprint -sha256`` prints them; the CLI's ``login --ca-fingerprint``
computes the same.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpuclusters.core.clientconfig import replace_atomically
from gpuclusters.core.errors import NotFoundError
from gpuclusters.layers.kubernetes import pki
from gpuclusters.server.settings import Settings

CA_VALIDITY = timedelta(days=20 * 365)
SERVER_VALIDITY = timedelta(days=397)
RENEW_BEFORE = timedelta(days=30)
"""A server certificate expiring within this is reissued at start."""
BACKDATE = timedelta(minutes=5)
"""Certificates are valid from a little before "now" (users' clocks may lag)."""

TLS_DIR = "tls"
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"

LOCAL_DNS = "localhost"
LOCAL_IP = ipaddress.ip_address("127.0.0.1")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TlsSetupError(Exception):
    """The TLS material cannot be made or loaded; the message says what to do."""


@dataclass(frozen=True)
class ServerTls:
    """What the TLS listener loads, and the CA users are given (if any)."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None


def tls_dir(home: Path) -> Path:
    return home / TLS_DIR


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 fingerprint of the first certificate in ``cert_pem``:
    ``AB:CD:...`` (32 pairs). Raises ``ValueError`` for something else."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def subject_alt_names(gateway_host: str) -> tuple[list[str], list[IPAddress]]:
    """The DNS names and IP addresses a server certificate for
    ``gateway_host`` carries: that host plus localhost and 127.0.0.1."""
    dns: list[str] = []
    ips: list[IPAddress] = []
    try:
        ips.append(ipaddress.ip_address(gateway_host.strip("[]")))
    except ValueError:
        dns.append(gateway_host.lower().rstrip("."))
    if LOCAL_DNS not in dns:
        dns.append(LOCAL_DNS)
    if LOCAL_IP not in ips:
        ips.append(LOCAL_IP)
    return dns, ips


# --- files -----------------------------------------------------------------------------


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TlsSetupError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(pem: bytes, path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsSetupError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsSetupError(f"{path} is not an ECDSA key ({type(key).__name__})")
    return key


def _load_cert(pem: bytes, path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise TlsSetupError(f"{path} is not a PEM certificate: {exc}") from exc


# --- the CA ----------------------------------------------------------------------------


def _new_ca() -> pki.KeyPair:
    return pki.new_ca("gpuclusters API CA", days=CA_VALIDITY.days)


def _ensure_ca(d: Path, now: datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = d / CA_CERT, d / CA_KEY
    cert_pem, key_pem = _read(cert_path), _read(key_path)
    if cert_pem is None:
        # Never handed out (a key alone is a first start cut short): make one.
        pair = _new_ca()
        replace_atomically(key_path, pair.key, 0o600)
        replace_atomically(cert_path, pair.cert, 0o644)
        return _load_cert(pair.cert, cert_path), _load_key(pair.key, key_path)
    if key_pem is None:
        raise TlsSetupError(
            f"{key_path} is missing, so the CA in {cert_path} cannot sign; restore it, or "
            f"remove {d} to make a new CA (users then have to trust the new one)"
        )
    cert, key = _load_cert(cert_pem, cert_path), _load_key(key_pem, key_path)
    if cert.public_key() != key.public_key():
        raise TlsSetupError(f"{key_path} is not the key of {cert_path}; restore it or remove {d}")
    if cert.not_valid_after_utc <= now:
        raise TlsSetupError(
            f"the CA in {cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}; "
            f"remove {d} to make a new one (users then have to trust the new one)"
        )
    return cert, key


# --- the server certificate ---------------------------------------------------------------


def _fits(
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    want: tuple[list[str], list[IPAddress]],
    now: datetime,
) -> bool:
    if cert.public_key() != key.public_key():
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    if cert.not_valid_after_utc - RENEW_BEFORE <= now or cert.not_valid_before_utc > now:
        return False
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    dns, ips = want
    return set(san.get_values_for_type(x509.DNSName)) == set(dns) and set(
        san.get_values_for_type(x509.IPAddress)
    ) == set(ips)


def _issue_server(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    names: tuple[list[str], list[IPAddress]],
    now: datetime,
) -> pki.KeyPair:
    dns, ips = names
    ca_pair = pki.KeyPair(cert=ca.public_bytes(serialization.Encoding.PEM), key=_key_pem(ca_key))
    return pki.issue(
        ca_pair,
        dns[0] if dns else str(ips[0]),
        dns_names=dns,
        ip_addresses=[str(ip) for ip in ips],
        server=True,
        days=SERVER_VALIDITY.days,
        now=now,
    )


def ensure_pki(home: Path, gateway_host: str, *, now: datetime | None = None) -> ServerTls:
    """Make (first start) or load the CA in ``home/tls``, and (re)issue the
    server certificate unless the one there still fits ``gateway_host``."""
    now = now or datetime.now(UTC)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    d = tls_dir(home)
    d.mkdir(exist_ok=True, mode=0o700)
    ca, ca_key = _ensure_ca(d, now)
    want = subject_alt_names(gateway_host)
    cert_path, key_path = d / SERVER_CERT, d / SERVER_KEY
    cert_pem, key_pem = _read(cert_path), _read(key_path)
    fits = False
    if cert_pem is not None and key_pem is not None:
        try:
            fits = _fits(
                _load_cert(cert_pem, cert_path), _load_key(key_pem, key_path), ca, want, now
            )
        except TlsSetupError:
            fits = False  # ours to replace
    if not fits:
        pair = _issue_server(ca, ca_key, want, now)
        replace_atomically(key_path, pair.key, 0o600)
        replace_atomically(cert_path, pair.cert, 0o644)
    return ServerTls(cert_file=cert_path, key_file=key_path, ca_file=d / CA_CERT)


def _check_operator_files(cert_file: Path, key_file: Path) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    except FileNotFoundError as exc:
        raise TlsSetupError(f"{exc.filename or cert_file}: no such file") from exc
    except (ssl.SSLError, OSError) as exc:
        raise TlsSetupError(
            f"cannot use {cert_file} with {key_file} (a PEM certificate and its unencrypted "
            f"key): {exc}"
        ) from exc


def server_tls(settings: Settings) -> ServerTls | None:
    """The TLS listener's material for ``settings``; ``None`` when TLS is off.

    Raises :class:`TlsSetupError` when it cannot be made or loaded."""
    if not settings.tls_enabled:
        return None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        _check_operator_files(settings.tls_cert_file, settings.tls_key_file)
        if settings.tls_ca_file is not None:
            ca_pem = _read(settings.tls_ca_file)
            if ca_pem is None:
                raise TlsSetupError(f"{settings.tls_ca_file}: no such file")
            _load_cert(ca_pem, settings.tls_ca_file)
        return ServerTls(
            cert_file=settings.tls_cert_file,
            key_file=settings.tls_key_file,
            ca_file=settings.tls_ca_file,
        )
    return ensure_pki(settings.home, settings.gateway_host)


def served_ca_file(settings: Settings) -> Path | None:
    """The CA certificate users are given for ``settings``, without making
    anything: the operator's ``tls_ca_file``, or our own CA; ``None`` when
    TLS is off or an operator certificate comes without a CA."""
    if not settings.tls_enabled:
        return None
    if settings.tls_cert_file is not None:
        return settings.tls_ca_file
    return tls_dir(settings.home) / CA_CERT


def read_served_ca(settings: Settings) -> str:
    """The PEM of :func:`served_ca_file`; :class:`NotFoundError` without one."""
    path = served_ca_file(settings)
    if path is None:
        why = (
            "it uses an operator certificate without tls_ca_file"
            if settings.tls_enabled
            else "TLS is off"
        )
        raise NotFoundError(f"this server hands out no CA certificate: {why}")
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotFoundError(f"this server's CA certificate cannot be read: {exc}") from exc
