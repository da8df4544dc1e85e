"""The API's TLS material (server/security/tls.py), the TLS settings, the
``/v1/tls/ca.pem`` route and what ``gpuclusters up`` announces about it."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from pydantic import ValidationError

from gpuclusters.core.errors import NotFoundError
from gpuclusters.layers.kubernetes import pki
from gpuclusters.server.app import announcement, create_app
from gpuclusters.server.security import tls
from gpuclusters.server.settings import Settings


@pytest.fixture(autouse=True)
def _no_tls_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "GPUCLUSTERS_PUBLIC_HOST",
        "GPUCLUSTERS_TLS",
        "GPUCLUSTERS_TLS_HOST",
        "GPUCLUSTERS_TLS_PORT",
        "GPUCLUSTERS_TLS_CERT_FILE",
        "GPUCLUSTERS_TLS_KEY_FILE",
        "GPUCLUSTERS_TLS_CA_FILE",
    ):
        monkeypatch.delenv(var, raising=False)


def cert_of(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(path: Path) -> tuple[set[str], set[str]]:
    san = cert_of(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        set(san.get_values_for_type(x509.DNSName)),
        {str(a) for a in san.get_values_for_type(x509.IPAddress)},
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def settings(home: Path, **values: Any) -> Settings:
    return Settings(home=home, **values)


# --- the PKI -------------------------------------------------------------------------------


def test_first_start_makes_a_ca_and_a_server_certificate_it_signs(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path / "home", "gw.test")

    d = tmp_path / "home" / "tls"
    assert made == tls.ServerTls(
        cert_file=d / "server.pem", key_file=d / "server-key.pem", ca_file=d / "ca.pem"
    )
    assert mode(d) == 0o700
    assert (mode(d / "ca.pem"), mode(d / "ca-key.pem")) == (0o644, 0o600)
    assert (mode(d / "server.pem"), mode(d / "server-key.pem")) == (0o644, 0o600)
    ca, server = cert_of(d / "ca.pem"), cert_of(d / "server.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.not_valid_after_utc - ca.not_valid_before_utc > timedelta(days=19 * 365)
    server.verify_directly_issued_by(ca)
    assert sans(d / "server.pem") == ({"gw.test", "localhost"}, {"127.0.0.1"})
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in usages


def test_a_real_tls_client_accepts_the_pair_for_each_name(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path, "gw.test")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(made.cert_file, made.key_file)
    for name in ("gw.test", "localhost", "127.0.0.1"):
        client_ctx = ssl.create_default_context(cafile=str(made.ca_file))
        handshake(client_ctx, server_ctx, name)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ssl.create_default_context(cafile=str(made.ca_file)), server_ctx, "other.test")


def handshake(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext, name: str) -> None:
    """A TLS handshake through memory BIOs: no socket, no network."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for side, obj in (("client", client), ("server", server)):
            if done[side]:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


@pytest.mark.parametrize(
    ("host", "dns", "ips"),
    [
        ("10.229.0.7", {"localhost"}, {"10.229.0.7", "127.0.0.1"}),
        ("fd00::7", {"localhost"}, {"fd00::7", "127.0.0.1"}),
        ("GW.Test.", {"gw.test", "localhost"}, {"127.0.0.1"}),
        ("127.0.0.1", {"localhost"}, {"127.0.0.1"}),  # no duplicates
    ],
)
def test_ip_hosts_get_ip_sans_and_names_get_dns_sans(
    tmp_path: Path, host: str, dns: set[str], ips: set[str]
) -> None:
    made = tls.ensure_pki(tmp_path, host)
    assert sans(made.cert_file) == (dns, ips)
    got_dns, got_ips = tls.subject_alt_names(host)
    assert len(got_dns) == len(set(got_dns)) and len(got_ips) == len(set(got_ips))
    assert {str(a) for a in got_ips} == ips
    assert all(isinstance(a, ipaddress.IPv4Address | ipaddress.IPv6Address) for a in got_ips)


def test_a_later_start_keeps_everything_that_still_fits(tmp_path: Path) -> None:
    tls.ensure_pki(tmp_path, "gw.test")
    d = tmp_path / "tls"
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    tls.ensure_pki(tmp_path, "gw.test")

    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_a_new_gateway_host_reissues_the_server_certificate_not_the_ca(tmp_path: Path) -> None:
    first = tls.ensure_pki(tmp_path, "gw.test")
    ca_before = first.ca_file.read_bytes() if first.ca_file else b""
    key_before = (tmp_path / "tls" / "ca-key.pem").read_bytes()

    again = tls.ensure_pki(tmp_path, "10.229.0.9")

    assert again.ca_file is not None
    assert again.ca_file.read_bytes() == ca_before
    assert (tmp_path / "tls" / "ca-key.pem").read_bytes() == key_before
    assert sans(again.cert_file) == ({"localhost"}, {"10.229.0.9", "127.0.0.1"})
    cert_of(again.cert_file).verify_directly_issued_by(cert_of(again.ca_file))


def test_a_server_certificate_near_expiry_is_reissued(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    made = tls.ensure_pki(tmp_path, "gw.test", now=now)
    old = cert_of(made.cert_file)

    tls.ensure_pki(tmp_path, "gw.test", now=now + tls.SERVER_VALIDITY - timedelta(days=40))
    assert cert_of(made.cert_file).serial_number == old.serial_number  # still 40 days left

    tls.ensure_pki(tmp_path, "gw.test", now=now + tls.SERVER_VALIDITY - timedelta(days=10))
    renewed = cert_of(made.cert_file)
    assert renewed.serial_number != old.serial_number
    assert renewed.not_valid_after_utc > old.not_valid_after_utc


def test_a_server_key_that_does_not_match_is_replaced(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path, "gw.test")
    other = tls.ensure_pki(tmp_path / "other", "gw.test")
    made.key_file.write_bytes(other.key_file.read_bytes())

    tls.ensure_pki(tmp_path, "gw.test")

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(made.cert_file, made.key_file)  # a matching pair again


def test_a_server_certificate_of_another_ca_is_replaced(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path, "gw.test")
    other = tls.ensure_pki(tmp_path / "other", "gw.test")
    made.cert_file.write_bytes(other.cert_file.read_bytes())
    made.key_file.write_bytes(other.key_file.read_bytes())

    tls.ensure_pki(tmp_path, "gw.test")

    assert made.ca_file is not None
    cert_of(made.cert_file).verify_directly_issued_by(cert_of(made.ca_file))


def test_a_ca_without_its_key_is_an_error_never_a_new_ca(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path, "gw.test")
    (tmp_path / "tls" / "ca-key.pem").unlink()
    assert made.ca_file is not None
    ca_before = made.ca_file.read_bytes()

    with pytest.raises(tls.TlsSetupError, match=r"ca-key\.pem is missing.*remove"):
        tls.ensure_pki(tmp_path, "gw.test")
    assert made.ca_file.read_bytes() == ca_before


def test_a_ca_key_of_another_ca_is_an_error(tmp_path: Path) -> None:
    tls.ensure_pki(tmp_path, "gw.test")
    tls.ensure_pki(tmp_path / "other", "gw.test")
    (tmp_path / "tls" / "ca-key.pem").write_bytes(
        (tmp_path / "other" / "tls" / "ca-key.pem").read_bytes()
    )
    with pytest.raises(tls.TlsSetupError, match="is not the key of"):
        tls.ensure_pki(tmp_path, "gw.test")


def test_a_ca_key_alone_is_a_first_start_cut_short(tmp_path: Path) -> None:
    tls.ensure_pki(tmp_path, "gw.test")
    (tmp_path / "tls" / "ca.pem").unlink()

    made = tls.ensure_pki(tmp_path, "gw.test")

    assert made.ca_file is not None
    cert_of(made.cert_file).verify_directly_issued_by(cert_of(made.ca_file))


def test_fingerprint_is_openssls_sha256_form(tmp_path: Path) -> None:
    made = tls.ensure_pki(tmp_path, "gw.test")
    assert made.ca_file is not None
    pem = made.ca_file.read_bytes()

    fp = tls.fingerprint(pem)

    assert fp == cert_of(made.ca_file).fingerprint(hashes.SHA256()).hex(":").upper()
    assert len(fp) == 95 and fp.count(":") == 31
    with pytest.raises(ValueError):
        tls.fingerprint(b"not a certificate")


# --- settings and what is served ---------------------------------------------------------


def test_tls_is_on_with_a_public_host_or_an_operator_certificate(tmp_path: Path) -> None:
    assert not settings(tmp_path).tls_enabled
    assert settings(tmp_path, public_host="gw.test").tls_enabled
    assert not settings(tmp_path, public_host="gw.test", tls="off").tls_enabled
    assert settings(tmp_path, tls="on").tls_enabled
    pair = {"tls_cert_file": tmp_path / "c.pem", "tls_key_file": tmp_path / "k.pem"}
    assert settings(tmp_path, **pair).tls_enabled


def test_tls_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="set both or neither"):
        settings(tmp_path, tls_cert_file=tmp_path / "c.pem")
    with pytest.raises(ValidationError):
        settings(tmp_path, tls="maybe")
    with pytest.raises(ValidationError):
        settings(tmp_path, tls_port=0)


def test_tls_url(tmp_path: Path) -> None:
    assert settings(tmp_path, public_host="gw.test").tls_url == "https://gw.test:8443"
    assert settings(tmp_path, public_host="fd00::1", tls_port=9443).tls_url == (
        "https://[fd00::1]:9443"
    )


def test_settings_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCLUSTERS_TLS", "on")
    monkeypatch.setenv("GPUCLUSTERS_TLS_PORT", "9443")
    monkeypatch.setenv("GPUCLUSTERS_TLS_HOST", "127.0.0.1")
    s = settings(tmp_path)
    assert (s.tls, s.tls_port, s.tls_host) == ("on", 9443, "127.0.0.1")


def test_server_tls_is_none_when_off_and_our_pki_otherwise(tmp_path: Path) -> None:
    assert tls.server_tls(settings(tmp_path)) is None
    assert not (tmp_path / "tls").exists()

    made = tls.server_tls(settings(tmp_path, public_host="gw.test"))

    assert made is not None and made.ca_file == tmp_path / "tls" / "ca.pem"
    assert tls.served_ca_file(settings(tmp_path, public_host="gw.test")) == made.ca_file


def operator_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    ca = pki.new_ca("operator CA")
    leaf = pki.issue(ca, "api.example.test", dns_names=["api.example.test"], server=True)
    paths = tmp_path / "op-cert.pem", tmp_path / "op-key.pem", tmp_path / "op-ca.pem"
    for path, data in zip(paths, (leaf.cert, leaf.key, ca.cert), strict=True):
        path.write_bytes(data)
    return paths


def test_an_operator_certificate_is_used_as_given(tmp_path: Path) -> None:
    cert, key, ca = operator_files(tmp_path)
    s = settings(tmp_path / "home", tls_cert_file=cert, tls_key_file=key, tls_ca_file=ca)

    made = tls.server_tls(s)

    assert made == tls.ServerTls(cert_file=cert, key_file=key, ca_file=ca)
    assert not (tmp_path / "home" / "tls").exists()  # no CA of our own
    assert tls.read_served_ca(s) == ca.read_text()
    without_ca = settings(tmp_path / "home", tls_cert_file=cert, tls_key_file=key)
    assert tls.served_ca_file(without_ca) is None
    with pytest.raises(NotFoundError, match="operator certificate"):
        tls.read_served_ca(without_ca)


def test_an_operator_key_that_does_not_fit_is_an_error(tmp_path: Path) -> None:
    cert, _, _ = operator_files(tmp_path)
    other = pki.issue(pki.new_ca("x"), "x.test", dns_names=["x.test"], server=True)
    (tmp_path / "wrong-key.pem").write_bytes(other.key)
    s = settings(tmp_path, tls_cert_file=cert, tls_key_file=tmp_path / "wrong-key.pem")
    with pytest.raises(tls.TlsSetupError, match="cannot use"):
        tls.server_tls(s)
    missing = settings(tmp_path, tls_cert_file=tmp_path / "nope.pem", tls_key_file=cert)
    with pytest.raises(tls.TlsSetupError, match="no such file"):
        tls.server_tls(missing)


def test_no_ca_is_served_when_tls_is_off(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="TLS is off"):
        tls.read_served_ca(settings(tmp_path))


async def test_the_ca_route_answers_the_pem_without_a_key(tmp_path: Path) -> None:
    s = settings(tmp_path, public_host="gw.test")
    made = tls.ensure_pki(tmp_path, s.gateway_host)
    app = create_app(s)
    app.state.runtime = SimpleNamespace(settings=s)  # the route reads only the settings
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        r = await http.get("/v1/tls/ca.pem")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert made.ca_file is not None and r.text == made.ca_file.read_text()

        app.state.runtime = SimpleNamespace(settings=settings(tmp_path))
        r = await http.get("/v1/tls/ca.pem")
        assert r.status_code == 404
        assert r.json()["code"] == "not_found"
    assert "/v1/tls/ca.pem" in app.openapi()["paths"]


def test_up_announces_the_tls_url_and_the_ca_fingerprint(tmp_path: Path) -> None:
    s = settings(tmp_path, public_host="gw.test", tls_port=9443)
    assert "https://" not in announcement(s.model_copy(update={"tls": "off"}))
    made = tls.ensure_pki(tmp_path, s.gateway_host)
    assert made.ca_file is not None

    text = announcement(s)

    fp = tls.fingerprint(made.ca_file.read_bytes())
    assert "https://gw.test:9443" in text
    assert fp in text
    assert str(made.ca_file) in text
    assert f"--ca-fingerprint {fp}" in text
