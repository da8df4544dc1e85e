"""The cluster's PKI: a CA per cluster, and the leaf certificates and keys
Kubernetes components and users authenticate with. Pure: no files, no
processes; callers decide where the PEM bytes live.

Design:

* ECDSA P-256 everywhere (CA, leaves, the service-account signing key):
  generating a key takes microseconds instead of RSA's tens of milliseconds,
  and every Kubernetes component (Go's crypto/tls, x509, ES256 JWTs) takes it.
* Keys are PEM, PKCS#8, unencrypted (``BEGIN PRIVATE KEY``), which
  kube-apiserver, kubelet, etcd and kubectl all load.
* Kubernetes reads identity from the client certificate's subject: the
  common name is the user name and each organization a group
  (``system:masters``, ``system:nodes``...), so :func:`issue` takes both and
  :func:`cert_subject` reads them back.
* Leaves are backdated five minutes (nodes' clocks may lag the control
  plane's) and never outlive their CA. Go ignores the common name of server
  certificates, so a server certificate without a DNS or IP SAN is refused
  here rather than at the first TLS handshake.
* Every certificate has a random 159-bit serial and a subject key
  identifier; leaves carry the CA's as authority key identifier, so chains
  build unambiguously even after a CA rotation.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BACKDATE = timedelta(minutes=5)
"""How far before "now" certificates become valid (clock skew between nodes)."""

_CURVE = ec.SECP256R1()

SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
"""CA keys :func:`issue` can sign with (ours are EC; RSA for an imported CA)."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(_CURVE)


def _key_pem(key: SigningKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _load_cert(cert_pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ValueError(f"not a PEM certificate: {exc}") from exc


def _load_signing_key(key_pem: bytes) -> SigningKey:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError(f"a CA key must be ECDSA or RSA, got {type(key).__name__}")
    return key


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    if not common_name:
        raise ValueError("a certificate needs a common name")
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")


def new_ca(common_name: str, *, days: int = 3650) -> KeyPair:
    """A self-signed CA (``CA:true``, critical; keyCertSign, cRLSign,
    digitalSignature) valid for ``days``."""
    _check_days(days)
    key = _new_key()
    name = _name(common_name)
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert=_cert_pem(cert), key=_key_pem(key))


def issue(
    ca: KeyPair,
    common_name: str,
    *,
    organizations: Sequence[str] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    client: bool = False,
    server: bool = False,
    days: int = 365,
    now: datetime | None = None,
    public_key: ec.EllipticCurvePublicKey | None = None,
) -> KeyPair:
    """A new key and a leaf certificate for it, signed by ``ca``. With
    ``public_key`` (from a CSR: the key never leaves its owner) the
    certificate is for that key and the returned ``key`` is empty.

    The subject is ``O=<organizations...>, CN=<common_name>`` (Kubernetes:
    groups and user). ``client``/``server`` choose the extended key usages;
    at least one is required, and a server certificate needs at least one
    DNS name or IP address. ``now`` is the start of validity (tests
    travel in time). Raises ``ValueError`` for bad input (an IP that
    does not parse, a CA that is not one).
    """
    _check_days(days)
    if not (client or server):
        raise ValueError("a leaf certificate must be for client and/or server authentication")
    try:
        ips = [ipaddress.ip_address(a) for a in ip_addresses]
    except ValueError as exc:
        raise ValueError(f"bad IP address SAN: {exc}") from exc
    if server and not (dns_names or ips):
        raise ValueError(
            f"server certificate {common_name!r} needs a DNS name or IP address "
            "(TLS clients ignore the common name)"
        )
    ca_cert = _load_cert(ca.cert)
    ca_key = _load_signing_key(ca.key)
    try:
        ca_constraints = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        ca_constraints = None
    if ca_constraints is None or not ca_constraints.ca:
        raise ValueError(f"{ca_cert.subject.rfc4514_string()} is not a CA certificate")
    if ca_cert.public_key() != ca_key.public_key():
        raise ValueError("the CA's key does not belong to its certificate")
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())

    key = _new_key() if public_key is None else None
    subject_key = key.public_key() if key is not None else public_key
    assert subject_key is not None
    now = now or datetime.now(UTC)
    # Never outlive the CA: a chain is only as valid as its shortest link.
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(subject_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(subject_key), critical=False)
        .add_extension(aki, critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    sans += [x509.IPAddress(ip) for ip in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert=_cert_pem(cert), key=_key_pem(key) if key is not None else b"")


def new_service_account_key() -> tuple[bytes, bytes]:
    """``(private PEM, public PEM)`` for kube-apiserver's
    ``--service-account-signing-key-file`` (and the controller manager's
    ``--service-account-private-key-file``) and ``--service-account-key-file``:
    an ES256 key; the public half is a SubjectPublicKeyInfo PEM."""
    key = _new_key()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _key_pem(key), public


def cert_expires_within(cert_pem: bytes, seconds: float) -> bool:
    """Whether the certificate is no longer valid ``seconds`` from now (an
    already expired certificate answers True): the renew-ahead check."""
    cert = _load_cert(cert_pem)
    return cert.not_valid_after_utc <= datetime.now(UTC) + timedelta(seconds=seconds)


def cert_subject(cert_pem: bytes) -> tuple[str, tuple[str, ...]]:
    """``(common name, organizations)`` of the certificate's subject, i.e. the
    Kubernetes user and groups it authenticates as (``""`` if it has no CN)."""
    subject = _load_cert(cert_pem).subject

    def values(oid: x509.ObjectIdentifier) -> list[str]:
        out = []
        for attr in subject.get_attributes_for_oid(oid):
            value = attr.value
            out.append(value if isinstance(value, str) else value.decode())
        return out

    common = values(NameOID.COMMON_NAME)
    return (common[0] if common else ""), tuple(values(NameOID.ORGANIZATION_NAME))


def cert_sans(cert_pem: bytes) -> frozenset[str]:
    """The DNS names and IP addresses (as text) a certificate is valid for."""
    try:
        ext = _load_cert(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return frozenset()
    names = ext.value.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in ext.value.get_values_for_type(x509.IPAddress)]
    return frozenset([*names, *ips])


def split_names(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(dns_names, ip_addresses)`` of host names that may be either."""
    dns, ips = [], []
    for name in names:
        try:
            ips.append(str(ipaddress.ip_address(name)))
        except ValueError:
            dns.append(name)
    return dns, ips
