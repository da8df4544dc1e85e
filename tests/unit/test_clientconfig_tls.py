"""The client's side of the API over TLS: ``ca_file`` in config.toml, where
the client finds it, fetching a CA by fingerprint, and how TLS failures are
reported. No network: canned answers on ``httpx.MockTransport``."""

from __future__ import annotations

import ssl
import stat
import tomllib
from pathlib import Path

import httpx
import pytest

from gpuclusters.client import Client, ClientConfigError, ValidationError
from gpuclusters.client._session import UntrustedServerError
from gpuclusters.client.client import _fingerprint_bytes, fetch_ca_certificate
from gpuclusters.client.errors import ConnectionFailedError, UnexpectedResponseError
from gpuclusters.core.clientconfig import (
    StoredConfig,
    read_config,
    write_ca_file,
    write_config,
)
from gpuclusters.layers.kubernetes import pki
from gpuclusters.server.security.tls import fingerprint

CA = pki.new_ca("test CA")
OTHER_CA = pki.new_ca("other CA")


# --- config.toml ---------------------------------------------------------------------------


def test_ca_file_round_trips_and_is_left_out_when_unset(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, url="https://gw.test:8443", api_key="k", project="p", ca_file="/x/ca.pem"
    )
    assert read_config(tmp_path) == StoredConfig(
        url="https://gw.test:8443", api_key="k", project="p", ca_file="/x/ca.pem"
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    write_config(tmp_path, url="http://127.0.0.1:8470", api_key="k")
    assert "ca_file" not in tomllib.loads(path.read_text())
    assert read_config(tmp_path).ca_file is None


def test_a_ca_file_that_is_not_a_string_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('url = "https://x:1"\nca_file = 3\n')
    with pytest.raises(ClientConfigError, match="ca_file must be a string") as err:
        read_config(tmp_path)
    assert err.value.field == "ca_file"


def test_write_ca_file_is_atomic_and_world_readable(tmp_path: Path) -> None:
    home = tmp_path / "new-home"
    path = write_ca_file(home, CA.cert)
    assert path == home / "ca.pem"
    assert path.read_bytes() == CA.cert
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    write_ca_file(home, OTHER_CA.cert)
    assert path.read_bytes() == OTHER_CA.cert
    assert sorted(p.name for p in home.iterdir()) == ["ca.pem"]  # no temporary left


# --- where the client finds its CA ----------------------------------------------------------


def test_from_config_uses_ca_file_from_config_then_env_then_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUCLUSTERS_CA_FILE", raising=False)
    monkeypatch.delenv("GPUCLUSTERS_URL", raising=False)
    good = tmp_path / "good.pem"
    good.write_bytes(CA.cert)
    write_config(tmp_path, url="https://gw.test:8443", api_key="k", ca_file=str(tmp_path / "gone"))

    # A missing CA file is reported as a configuration error naming it.
    with pytest.raises(ClientConfigError, match="gone: no such file") as err:
        Client.from_config(home=tmp_path)
    assert err.value.field == "ca_file"

    monkeypatch.setenv("GPUCLUSTERS_CA_FILE", str(good))
    Client.from_config(home=tmp_path).close()  # env beats the file

    monkeypatch.setenv("GPUCLUSTERS_CA_FILE", str(tmp_path / "also-gone"))
    with pytest.raises(ClientConfigError, match="also-gone"):
        Client.from_config(home=tmp_path)
    Client.from_config(home=tmp_path, ca_file=good).close()  # the argument beats both


def test_a_ca_file_that_is_not_a_certificate_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("hello")
    with pytest.raises(ClientConfigError, match="not a PEM CA certificate"):
        Client("https://gw.test:8443", "k", ca_file=bad)


def test_plain_http_never_reads_the_ca(tmp_path: Path) -> None:
    Client("http://127.0.0.1:8470", "k", ca_file=tmp_path / "gone").close()


def test_an_untrusted_certificate_says_how_to_trust_the_server() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
        cause.verify_message = "self-signed certificate in certificate chain"
        raise httpx.ConnectError("handshake failed", request=request) from cause

    with (
        Client("https://gw.test:8443", "k", transport=httpx.MockTransport(refuse)) as client,
        pytest.raises(UntrustedServerError) as err,
    ):
        client.whoami()
    assert err.value.code == "untrusted_server"
    assert isinstance(err.value, ConnectionFailedError)
    assert "self-signed certificate" in err.value.message
    assert "--ca-fingerprint" in err.value.message


def test_another_tls_failure_asks_whether_the_url_is_https() -> None:
    def garbage(request: httpx.Request) -> httpx.Response:
        cause = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
        raise httpx.ConnectError("handshake failed", request=request) from cause

    with (
        Client("https://gw.test:8470", "k", transport=httpx.MockTransport(garbage)) as client,
        pytest.raises(ConnectionFailedError, match="is it an https:// address"),
    ):
        client.whoami()


# --- fetching a CA by its fingerprint -------------------------------------------------------


def serve(body: bytes, status: int = 200) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/tls/ca.pem"
        assert "authorization" not in request.headers  # no key before trust
        return httpx.Response(status, content=body)

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    "style",
    [
        lambda fp: fp,
        lambda fp: fp.lower(),
        lambda fp: fp.replace(":", ""),
        lambda fp: f"SHA256:{fp}",
        lambda fp: f"sha256 Fingerprint={fp}",  # openssl x509 -fingerprint -sha256
        lambda fp: f"  {fp}\n",
    ],
)
def test_fetch_ca_certificate_takes_the_fingerprint_in_common_forms(style: object) -> None:
    assert callable(style)
    pem = fetch_ca_certificate(
        "https://gw.test:8443", fingerprint=style(fingerprint(CA.cert)), transport=serve(CA.cert)
    )
    assert pem == CA.cert


def test_only_the_fingerprinted_certificate_comes_back() -> None:
    pem = fetch_ca_certificate(
        "https://gw.test:8443/",
        fingerprint=fingerprint(CA.cert),
        transport=serve(CA.cert + OTHER_CA.cert),
    )
    assert pem == CA.cert


def test_a_ca_with_another_fingerprint_is_untrusted() -> None:
    with pytest.raises(UntrustedServerError, match="not the server") as err:
        fetch_ca_certificate(
            "https://gw.test:8443",
            fingerprint=fingerprint(CA.cert),
            transport=serve(OTHER_CA.cert),
        )
    assert fingerprint(OTHER_CA.cert) in err.value.message
    assert fingerprint(CA.cert) in err.value.message


@pytest.mark.parametrize("bad", ["", "AB:CD", "zz" * 32, fingerprint(CA.cert) + ":00"])
def test_a_malformed_fingerprint_is_invalid_input(bad: str) -> None:
    with pytest.raises(ValidationError) as err:
        _fingerprint_bytes(bad)
    assert err.value.field == "ca_fingerprint"


def test_fetching_needs_an_https_url_and_a_certificate_back() -> None:
    fp = fingerprint(CA.cert)
    with pytest.raises(ValidationError, match="https://"):
        fetch_ca_certificate("http://gw.test:8470", fingerprint=fp, transport=serve(CA.cert))
    with pytest.raises(UnexpectedResponseError, match="not a PEM certificate"):
        fetch_ca_certificate("https://gw.test:8443", fingerprint=fp, transport=serve(b"<html>"))
    not_found = b'{"code": "not_found", "message": "TLS is off", "field": null}'
    with pytest.raises(Exception, match="TLS is off") as err:
        fetch_ca_certificate(
            "https://gw.test:8443", fingerprint=fp, transport=serve(not_found, 404)
        )
    assert getattr(err.value, "code", None) == "not_found"
