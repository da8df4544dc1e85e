"""SSH keys, certificate authorities and certificates (pure, no I/O).

The service holds two SSH CAs per organization (``server/services/sshca``):
a *user* CA whose certificates let members log in without registering a
key (sshd trusts it through ``TrustedUserCAKeys``, principal = the member's
Unix account), and a *host* CA that signs every node's host key, so a CLI
that trusts it (an ``@cert-authority`` line in known_hosts) connects to a
new cluster without a question and refuses any other host.

Everything here is computation with ``cryptography``'s OpenSSH support:
parse and fingerprint public keys users send, make Ed25519 key pairs, sign
user and host certificates. Certificates start a minute in the past (clock
skew between the server and nodes) and carry a random serial.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import ssh

# Key types accepted from users; DSA and short RSA keys are refused (OpenSSH
# itself no longer accepts DSA, and NIST's floor for RSA is 2048 bits).
MIN_RSA_BITS = 2048
ACCEPTED_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
)
MAX_KEY_LINE = 16 * 1024
CLOCK_SKEW = timedelta(minutes=1)
# What a certificate lets its holder do: an interactive shell with a pty,
# agent and port forwarding (users tunnel to notebooks); no X11.
USER_EXTENSIONS = (
    "permit-agent-forwarding",
    "permit-port-forwarding",
    "permit-pty",
    "permit-user-rc",
)
_COMMENT_RE = re.compile(r"^[\x20-\x7e]*$")


class SshKeyError(ValueError):
    """A public key or certificate request that cannot be accepted."""


@dataclass(frozen=True, slots=True)
class PublicKey:
    """A user's public key, normalised to ``"<type> <base64>"``."""

    key_type: str
    openssh: str
    fingerprint: str  # "SHA256:<base64 without padding>", as ssh-keygen -l shows it
    comment: str
    bits: int


@dataclass(frozen=True, slots=True)
class KeyPair:
    private_openssh: str  # "-----BEGIN OPENSSH PRIVATE KEY-----" ...
    public_openssh: str  # "ssh-ed25519 AAAA..."


def fingerprint(openssh_public: str) -> str:
    """``SHA256:...`` of the key blob, as ``ssh-keygen -lf`` prints it."""
    parts = openssh_public.split()
    if len(parts) < 2:
        raise SshKeyError("expected '<type> <base64 key> [comment]'")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError as exc:
        raise SshKeyError("the key's base64 part is not valid base64") from exc
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


def parse_public_key(text: str) -> PublicKey:
    """Validate one OpenSSH public key line (what ``id_ed25519.pub`` holds).

    Raises :class:`SshKeyError` naming what is wrong: not one line, an
    unknown or refused type, a blob that does not decode, RSA below 2048
    bits, a certificate instead of a key, or a private key pasted by mistake.
    """
    line = text.strip()
    if not line:
        raise SshKeyError("the key is empty")
    if len(line) > MAX_KEY_LINE:
        raise SshKeyError(f"the key is longer than {MAX_KEY_LINE} characters")
    if "PRIVATE KEY" in line:
        raise SshKeyError("this is a private key; send the public key (the .pub file)")
    if "\n" in line:
        raise SshKeyError("expected one key on one line")
    parts = line.split(None, 2)
    if len(parts) < 2:
        raise SshKeyError("expected '<type> <base64 key> [comment]'")
    key_type, blob = parts[0], parts[1]
    comment = parts[2] if len(parts) > 2 else ""
    if key_type.endswith("-cert-v01@openssh.com"):
        raise SshKeyError("this is a certificate; send the public key itself")
    if key_type not in ACCEPTED_TYPES:
        raise SshKeyError(
            f"key type {key_type!r} is not accepted; use one of {', '.join(ACCEPTED_TYPES)}"
        )
    if not _COMMENT_RE.match(comment):
        raise SshKeyError("the key's comment must be printable ASCII")
    try:
        key = serialization.load_ssh_public_key(f"{key_type} {blob}".encode())
    except (ValueError, TypeError) as exc:
        raise SshKeyError(f"not a valid {key_type} public key") from exc
    if isinstance(key, rsa.RSAPublicKey):
        bits = key.key_size
        if bits < MIN_RSA_BITS:
            raise SshKeyError(f"RSA keys need at least {MIN_RSA_BITS} bits, this one has {bits}")
    elif isinstance(key, ec.EllipticCurvePublicKey):
        bits = key.curve.key_size
    elif isinstance(key, ed25519.Ed25519PublicKey):
        bits = 256
    else:  # pragma: no cover - load_ssh_public_key only returns the types above
        raise SshKeyError(f"key type {key_type!r} is not accepted")
    normal = f"{key_type} {blob}"
    return PublicKey(
        key_type=key_type,
        openssh=normal,
        fingerprint=fingerprint(normal),
        comment=comment,
        bits=bits,
    )


def new_keypair(comment: str = "") -> KeyPair:
    """A fresh Ed25519 key pair in OpenSSH formats."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    return KeyPair(private_openssh=private, public_openssh=f"{public} {comment}".strip())


def public_of(private_openssh: str) -> str:
    """The OpenSSH public key line of a private key (no comment)."""
    key = _load_signer(private_openssh)
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def _load_signer(private_openssh: str) -> ed25519.Ed25519PrivateKey:
    key = serialization.load_ssh_private_key(private_openssh.encode(), password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SshKeyError("CA keys are Ed25519")
    return key


def _sign(
    *,
    ca_private: str,
    public_key: str,
    cert_type: ssh.SSHCertificateType,
    key_id: str,
    principals: list[str],
    valid_for: timedelta,
    now: datetime | None,
    extensions: tuple[str, ...] = (),
) -> str:
    if not principals:
        raise SshKeyError("a certificate needs at least one principal")
    if valid_for <= timedelta(0):
        raise SshKeyError("a certificate's validity must be positive")
    try:
        subject = serialization.load_ssh_public_key(" ".join(public_key.split()[:2]).encode())
    except (ValueError, TypeError, IndexError) as exc:
        raise SshKeyError("the key to sign is not a valid OpenSSH public key") from exc
    if not isinstance(
        subject, ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    ):
        raise SshKeyError("the key to sign has a type that cannot be certified")
    start = (now or datetime.now(UTC)) - CLOCK_SKEW
    builder = (
        ssh.SSHCertificateBuilder()
        .public_key(subject)
        .serial(int.from_bytes(os.urandom(8), "big"))
        .type(cert_type)
        .key_id(key_id.encode())
        .valid_principals([p.encode() for p in principals])
        .valid_after(int(start.timestamp()))
        .valid_before(int((start + CLOCK_SKEW + valid_for).timestamp()))
    )
    for name in extensions:
        builder = builder.add_extension(name.encode(), b"")
    cert = builder.sign(_load_signer(ca_private))
    return cert.public_bytes().decode()


def sign_user_key(
    *,
    ca_private: str,
    public_key: str,
    principal: str,
    key_id: str,
    valid_for: timedelta,
    now: datetime | None = None,
) -> str:
    """A user certificate (``ssh-ed25519-cert-v01@openssh.com ...``) for one
    principal, the member's Unix account."""
    return _sign(
        ca_private=ca_private,
        public_key=public_key,
        cert_type=ssh.SSHCertificateType.USER,
        key_id=key_id,
        principals=[principal],
        valid_for=valid_for,
        now=now,
        extensions=USER_EXTENSIONS,
    )


def sign_host_key(
    *,
    ca_private: str,
    public_key: str,
    principals: list[str],
    key_id: str,
    valid_for: timedelta,
    now: datetime | None = None,
) -> str:
    """A host certificate naming every name and address clients use for
    the host (hostname, node address, the gateway's public host)."""
    return _sign(
        ca_private=ca_private,
        public_key=public_key,
        cert_type=ssh.SSHCertificateType.HOST,
        key_id=key_id,
        principals=principals,
        valid_for=valid_for,
        now=now,
    )


@dataclass(frozen=True, slots=True)
class CertInfo:
    key_id: str
    principals: tuple[str, ...]
    valid_after: datetime
    valid_before: datetime
    is_host: bool
    signed_by: str  # the CA's public key, "ssh-ed25519 AAAA..."


def inspect_certificate(cert_line: str) -> CertInfo:
    """What a certificate says (used to decide whether a node's host
    certificate is still good, and by tests)."""
    try:
        cert = ssh.load_ssh_public_identity(cert_line.strip().encode())
    except (ValueError, TypeError) as exc:
        raise SshKeyError("not an OpenSSH certificate") from exc
    if not isinstance(cert, ssh.SSHCertificate):
        raise SshKeyError("a plain public key, not a certificate")
    ca = cert.signature_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return CertInfo(
        key_id=cert.key_id.decode(),
        principals=tuple(p.decode() for p in cert.valid_principals),
        valid_after=datetime.fromtimestamp(cert.valid_after, UTC),
        valid_before=datetime.fromtimestamp(cert.valid_before, UTC),
        is_host=cert.type is ssh.SSHCertificateType.HOST,
        signed_by=ca.decode(),
    )


def known_hosts_line(host_ca_public: str, patterns: list[str], comment: str) -> str:
    """``@cert-authority PATTERNS KEY COMMENT``: trust hosts the CA signed,
    for these host patterns only."""
    if not patterns:
        raise SshKeyError("a known_hosts line needs at least one host pattern")
    key = " ".join(host_ca_public.split()[:2])
    return f"@cert-authority {','.join(patterns)} {key} {comment}".rstrip()


def host_pattern(host: str, port: int) -> str:
    """How known_hosts names a host on a port other than 22."""
    return host if port == 22 else f"[{host}]:{port}"
