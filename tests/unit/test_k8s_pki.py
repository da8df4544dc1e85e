"""The Kubernetes PKI helpers: chains verify (with cryptography and with the
openssl CLI), extensions are the ones Kubernetes components expect, and the
subject/expiry readers agree with what was issued."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpuclusters.layers.kubernetes.pki import (
    KeyPair,
    cert_expires_within,
    cert_subject,
    issue,
    new_ca,
    new_service_account_key,
)

E = TypeVar("E", bound=x509.ExtensionType)


@pytest.fixture(scope="module")
def ca() -> KeyPair:
    return new_ca("kubernetes-ca")


def _cert(pair: KeyPair) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pair.cert)


def _ext(cert: x509.Certificate, cls: type[E]) -> x509.Extension[E]:
    return cert.extensions.get_extension_for_class(cls)


def test_ca_is_a_self_signed_ca(ca: KeyPair) -> None:
    cert = _cert(ca)
    cert.verify_directly_issued_by(cert)
    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = _ext(cert, x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and ku.digital_signature
    assert not ku.key_encipherment
    _ext(cert, x509.SubjectKeyIdentifier)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert_subject(ca.cert) == ("kubernetes-ca", ())
    assert ca.key.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > timedelta(days=3649)


def test_server_leaf_chains_to_ca_with_sans_and_server_auth(ca: KeyPair) -> None:
    leaf = issue(
        ca,
        "kube-apiserver",
        dns_names=["kubernetes", "kubernetes.default.svc"],
        ip_addresses=["10.96.0.1", "127.0.0.1", "fd00::1"],
        server=True,
    )
    cert = _cert(leaf)
    cert.verify_directly_issued_by(_cert(ca))
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["kubernetes", "kubernetes.default.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.96.0.1"),
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("fd00::1"),
    ]
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = _ext(cert, x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment and not ku.key_cert_sign
    ca_ski = _ext(_cert(ca), x509.SubjectKeyIdentifier).value.digest
    assert _ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski


def test_leaf_is_backdated_and_never_outlives_its_ca(ca: KeyPair) -> None:
    before = datetime.now(UTC)
    cert = _cert(issue(ca, "u", client=True, days=365_000))
    assert cert.not_valid_before_utc <= before - timedelta(minutes=4)
    assert cert.not_valid_after_utc == _cert(ca).not_valid_after_utc


def test_client_leaf_carries_user_and_groups(ca: KeyPair) -> None:
    leaf = issue(ca, "alice", organizations=["system:masters", "devs"], client=True)
    cert = _cert(leaf)
    cert.verify_directly_issued_by(_cert(ca))
    assert cert_subject(leaf.cert) == ("alice", ("system:masters", "devs"))
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):
        _ext(cert, x509.SubjectAlternativeName)
    # The key is the certificate's, PKCS#8 PEM.
    assert leaf.key.startswith(b"-----BEGIN PRIVATE KEY-----")
    key = serialization.load_pem_private_key(leaf.key, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == cert.public_key()


def test_client_and_server_leaf_has_both_usages(ca: KeyPair) -> None:
    cert = _cert(issue(ca, "system:node:n1", dns_names=["n1"], client=True, server=True))
    assert set(_ext(cert, x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }


def test_leaf_of_another_ca_does_not_verify(ca: KeyPair) -> None:
    other = new_ca("other-ca")
    cert = _cert(issue(other, "bob", client=True))
    with pytest.raises((ValueError, TypeError)):
        cert.verify_directly_issued_by(_cert(ca))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "client and/or server"),
        ({"server": True}, "needs a DNS name or IP address"),
        ({"client": True, "ip_addresses": ["10.0.0.300"]}, "bad IP address"),
        ({"client": True, "days": 0}, "at least 1"),
    ],
)
def test_issue_refuses_bad_requests(ca: KeyPair, kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        issue(ca, "x", **kwargs)  # type: ignore[arg-type]


def test_issue_refuses_a_leaf_as_ca_and_a_mismatched_key(ca: KeyPair) -> None:
    leaf = issue(ca, "alice", client=True)
    with pytest.raises(ValueError, match="not a CA"):
        issue(leaf, "mallory", client=True)
    other = new_ca("other-ca")
    with pytest.raises(ValueError, match="does not belong"):
        issue(KeyPair(cert=ca.cert, key=other.key), "mallory", client=True)


def test_expiry_check(ca: KeyPair) -> None:
    leaf = issue(ca, "alice", client=True, days=1)
    assert not cert_expires_within(leaf.cert, 3600)
    assert cert_expires_within(leaf.cert, 2 * 86400)
    assert not cert_expires_within(ca.cert, 364 * 86400)


def test_service_account_key_pair_signs_and_verifies() -> None:
    private_pem, public_pem = new_service_account_key()
    assert private_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public_pem.startswith(b"-----BEGIN PUBLIC KEY-----")
    private = serialization.load_pem_private_key(private_pem, password=None)
    public = serialization.load_pem_public_key(public_pem)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(public, ec.EllipticCurvePublicKey)
    signature = private.sign(b"token", ec.ECDSA(hashes.SHA256()))
    public.verify(signature, b"token", ec.ECDSA(hashes.SHA256()))


# --- the openssl CLI agrees --------------------------------------------------------------

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")


def _openssl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)


@needs_openssl
def test_openssl_verifies_leaves_for_their_purpose(ca: KeyPair, tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(ca.cert)
    (tmp_path / "server.crt").write_bytes(
        issue(ca, "apiserver", dns_names=["kubernetes"], server=True).cert
    )
    (tmp_path / "client.crt").write_bytes(issue(ca, "alice", client=True).cert)
    ca_file = str(tmp_path / "ca.crt")

    for name, purpose in (("server", "sslserver"), ("client", "sslclient")):
        r = _openssl(
            "verify", "-CAfile", ca_file, "-purpose", purpose, str(tmp_path / f"{name}.crt")
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith(": OK")
    # A client certificate is not a server certificate.
    r = _openssl(
        "verify", "-CAfile", ca_file, "-purpose", "sslserver", str(tmp_path / "client.crt")
    )
    assert r.returncode != 0
    # The key file is one openssl reads as an EC key.
    (tmp_path / "ca.key").write_bytes(ca.key)
    r = _openssl("pkey", "-in", str(tmp_path / "ca.key"), "-noout", "-text")
    assert r.returncode == 0 and "prime256v1" in r.stdout, r.stderr


@needs_openssl
def test_openssl_checkend_agrees_with_expiry_check(ca: KeyPair, tmp_path: Path) -> None:
    path = tmp_path / "leaf.crt"
    path.write_bytes(issue(ca, "alice", client=True, days=1).cert)
    assert _openssl("x509", "-in", str(path), "-noout", "-checkend", "3600").returncode == 0
    assert _openssl("x509", "-in", str(path), "-noout", "-checkend", "172800").returncode == 1
