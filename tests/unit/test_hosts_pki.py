"""The certificates between the server and host agents
(``server/security/hosts_pki.py``): the two CAs are made once and kept,
agents' CSRs are signed for the address the server dials (EC keys only),
and the server's client context completes mutual TLS with an agent set up
as ``hostagent/main.py`` sets it up, and with nothing else."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuclusters.layers.kubernetes import pki
from gpuclusters.server.security.hosts_pki import (
    CLIENT_NAME,
    CsrError,
    HostsPki,
    agent_client_context,
    ensure_hosts_pki,
    sign_agent_csr,
)

ADDRESS = "10.9.8.7"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _csr(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, *, san: str = ADDRESS) -> str:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "whatever")]))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(san))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@pytest.fixture
def hosts_pki(tmp_path: Path) -> HostsPki:
    return ensure_hosts_pki(tmp_path / "home")


def test_ensure_hosts_pki_makes_two_cas_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = ensure_hosts_pki(home)
    second = ensure_hosts_pki(home)
    assert second == first  # the same CAs and client certificate, read back
    d = home / "hosts-pki"
    assert first.dir == d and _mode(d) & 0o077 == 0
    for name in ("hosts-ca", "control-ca", "client"):
        assert _mode(d / f"{name}.key") == 0o600, name
        assert _mode(d / f"{name}.crt") == 0o644, name
    assert first.hosts_ca_file.read_bytes() == first.hosts_ca.cert

    hosts_ca = x509.load_pem_x509_certificate(first.hosts_ca.cert)
    control_ca = x509.load_pem_x509_certificate(first.control_ca.cert)
    assert hosts_ca.public_key() != control_ca.public_key()
    client = x509.load_pem_x509_certificate(first.client.cert)
    client.verify_directly_issued_by(control_ca)  # the control CA signs the server...
    with pytest.raises((ValueError, TypeError)):
        client.verify_directly_issued_by(hosts_ca)  # ...the hosts CA does not
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == CLIENT_NAME
    usages = list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == [ExtendedKeyUsageOID.CLIENT_AUTH]

    # A client certificate lost after its key was written (a crash between
    # the two) is made again from the same control CA; the CAs stay.
    (d / "client.crt").unlink()
    third = ensure_hosts_pki(home)
    assert third.hosts_ca == first.hosts_ca and third.control_ca == first.control_ca
    assert third.client.cert != first.client.cert
    x509.load_pem_x509_certificate(third.client.cert).verify_directly_issued_by(control_ca)
    assert _mode(d / "client.key") == 0o600


def test_sign_agent_csr_for_the_address_the_server_dials(hosts_pki: HostsPki) -> None:
    key = _ec_key()
    # The CSR asks for another address: the server decides what it signs.
    cert_pem = sign_agent_csr(hosts_pki, _csr(key, san="192.0.2.1"), name="gpu-a1", address=ADDRESS)
    cert = x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(hosts_pki.hosts_ca.cert))
    assert cert.public_key() == key.public_key()
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-a1"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ADDRESS)]
    assert sans.get_values_for_type(x509.DNSName) == []
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}

    # A host name as the address becomes a DNS name.
    cert = x509.load_pem_x509_certificate(
        sign_agent_csr(hosts_pki, _csr(key), name="gpu-a1", address="gpu-a1.example")
    )
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["gpu-a1.example"]
    assert sans.get_values_for_type(x509.IPAddress) == []


def test_sign_agent_csr_refuses_what_it_cannot_sign(hosts_pki: HostsPki) -> None:
    for garbage in ("", "hello", "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n"):
        with pytest.raises(CsrError, match="not a PEM certificate request"):
            sign_agent_csr(hosts_pki, garbage, name="gpu-a1", address=ADDRESS)
    # A certificate is not a certificate request.
    with pytest.raises(CsrError, match="not a PEM certificate request"):
        sign_agent_csr(hosts_pki, hosts_pki.hosts_ca.cert.decode(), name="gpu-a1", address=ADDRESS)

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(CsrError, match="EC key"):
        sign_agent_csr(hosts_pki, _csr(rsa_key), name="gpu-a1", address=ADDRESS)

    # A CSR whose signature does not match its content (the key's owner did
    # not sign it): the last byte of the DER is the signature's.
    der = bytearray(
        x509.load_pem_x509_csr(_csr(_ec_key()).encode()).public_bytes(serialization.Encoding.DER)
    )
    der[-1] ^= 0x01
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(CsrError, match="does not verify"):
        sign_agent_csr(hosts_pki, tampered.decode(), name="gpu-a1", address=ADDRESS)
    assert issubclass(CsrError, ValueError)  # the join service maps it to 422 csr_pem


# -- mutual TLS, in memory ---------------------------------------------------------


def _agent_server_context(
    tmp_path: Path, hosts_pki: HostsPki, cert: bytes, key: bytes
) -> ssl.SSLContext:
    """What ``hostagent/main.py`` serves with: its certificate, client
    certificates required and checked against the control CA only."""
    cert_file, key_file = tmp_path / "agent.crt", tmp_path / "agent.key"
    cert_file.write_bytes(cert)
    key_file.write_bytes(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_file, key_file)
    ctx.load_verify_locations(cadata=hosts_pki.control_ca.cert.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _handshake(
    client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext, server_hostname: str
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """Complete a TLS handshake over memory BIOs and pass one message each
    way (in TLS 1.3 the server judges the client's certificate after the
    client thinks it is done); raises ``ssl.SSLError`` if either side refuses."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    c_done = s_done = False
    for _ in range(10):
        if not c_done:
            try:
                client.do_handshake()
                c_done = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        if not s_done:
            try:
                server.do_handshake()
                s_done = True
            except ssl.SSLWantReadError:
                pass
        c_in.write(s_out.read())
        if c_done and s_done:
            break
    assert c_done and s_done, "the handshake did not finish"
    client.write(b"ping")
    s_in.write(c_out.read())
    assert server.read(4) == b"ping"
    server.write(b"pong")
    c_in.write(s_out.read())
    assert client.read(4) == b"pong"
    return client, server


def _agent_pair(hosts_pki: HostsPki, address: str = ADDRESS) -> tuple[bytes, bytes]:
    key = _ec_key()
    return sign_agent_csr(hosts_pki, _csr(key), name="gpu-a1", address=address), _key_pem(key)


def test_the_server_and_an_agent_complete_mutual_tls(tmp_path: Path, hosts_pki: HostsPki) -> None:
    cert, key = _agent_pair(hosts_pki)
    agent = _agent_server_context(tmp_path, hosts_pki, cert, key)
    client, server = _handshake(agent_client_context(hosts_pki), agent, ADDRESS)
    # The agent sees the control plane's client certificate...
    client_der = x509.load_pem_x509_certificate(hosts_pki.client.cert).public_bytes(
        serialization.Encoding.DER
    )
    assert server.getpeercert(binary_form=True) == client_der
    # ...and the control plane sees the agent's.
    assert client.getpeercert(binary_form=True) == x509.load_pem_x509_certificate(
        cert
    ).public_bytes(serialization.Encoding.DER)

    # The server checks the address: an agent certificate for another one fails.
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        _handshake(agent_client_context(hosts_pki), agent, "10.9.8.8")


def test_mutual_tls_refuses_anything_else(tmp_path: Path, hosts_pki: HostsPki) -> None:
    cert, key = _agent_pair(hosts_pki)
    agent = _agent_server_context(tmp_path, hosts_pki, cert, key)

    # Another host's agent certificate (hosts CA) opens no agent.
    other_cert, other_key = _agent_pair(hosts_pki, "10.9.8.8")
    impostor = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    impostor.load_verify_locations(cadata=hosts_pki.hosts_ca.cert.decode())
    (tmp_path / "o.crt").write_bytes(other_cert)
    (tmp_path / "o.key").write_bytes(other_key)
    impostor.load_cert_chain(tmp_path / "o.crt", tmp_path / "o.key")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed") as info:
        _handshake(impostor, agent, ADDRESS)
    # (the agent refused it: the impostor itself trusts the agent's certificate)
    assert "IP address mismatch" not in str(info.value)

    # Nor does a caller without a client certificate.
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(cadata=hosts_pki.hosts_ca.cert.decode())
    with pytest.raises(ssl.SSLError, match="PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        _handshake(anonymous, agent, ADDRESS)

    # The server trusts the hosts CA only: a server certificate for the right
    # address from any other CA (here the control CA) is refused.
    fake = pki.issue(hosts_pki.control_ca, "gpu-a1", ip_addresses=[ADDRESS], server=True)
    not_an_agent = _agent_server_context(tmp_path, hosts_pki, fake.cert, fake.key)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _handshake(agent_client_context(hosts_pki), not_an_agent, ADDRESS)
