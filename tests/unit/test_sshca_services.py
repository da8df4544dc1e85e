"""The pure parts of the SSH services: error mapping of bad keys, default
key names, the gateway's known_hosts line and certificates' key ids."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpuclusters.core import models as api
from gpuclusters.core import sshca
from gpuclusters.core.errors import ValidationError
from gpuclusters.server.services.ssh import user_key_id
from gpuclusters.server.services.ssh_keys import default_name, parse_key
from gpuclusters.server.services.sshca import gateway_known_hosts, gateway_patterns


def test_bad_keys_are_invalid_input_on_public_key() -> None:
    with pytest.raises(ValidationError) as err:
        parse_key("ssh-dss AAAA")
    assert err.value.field == "public_key"
    assert err.value.message.startswith("public_key: key type 'ssh-dss' is not accepted")
    with pytest.raises(ValidationError, match="private key"):
        parse_key("-----BEGIN OPENSSH PRIVATE KEY-----")


def test_default_name_is_the_comment_cut_to_size() -> None:
    key = parse_key(sshca.new_keypair("alice@laptop").public_openssh)
    assert default_name(key, None) == "alice@laptop"
    assert default_name(key, "ci") == "ci"
    long = parse_key(sshca.new_keypair("x" * 300).public_openssh)
    assert default_name(long, None) == "x" * api.SSH_KEY_NAME_MAX
    assert default_name(parse_key(sshca.new_keypair().public_openssh), None) == ""


def test_key_create_model_checks_the_name() -> None:
    assert api.SshKeyCreate(public_key="k", name="  a b ").name == "a b"
    assert api.SshKeyCreate(public_key="k", name=" " + "x" * 128).name == "x" * 128
    # The rule is the pattern the OpenAPI document states: what the
    # document refuses the server refuses.
    for bad in ("", "   ", "\ta", "a\nb", "é", "x" * 129):
        with pytest.raises(ValueError, match="printable"):
            api.SshKeyCreate(public_key="k", name=bad)


def test_gateway_patterns_cover_every_port() -> None:
    assert gateway_patterns("gw.example") == ["[gw.example]:*", "gw.example"]
    ca = sshca.new_keypair("gpuclusters-host-ca").public_openssh
    line = gateway_known_hosts(host_ca_public=ca, gateway_host="10.1.2.3", organization="acme")
    key = " ".join(ca.split()[:2])
    assert line == f"@cert-authority [10.1.2.3]:*,10.1.2.3 {key} gpuclusters:acme"


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_ssh_keygen_finds_the_gateway_on_any_port(tmp_path: Path) -> None:
    ca = sshca.new_keypair().public_openssh
    known = tmp_path / "known_hosts"
    known.write_text(
        gateway_known_hosts(host_ca_public=ca, gateway_host="10.1.2.3", organization="o") + "\n"
    )

    def found(host: str) -> bool:
        r = subprocess.run(["ssh-keygen", "-F", host, "-f", str(known)], capture_output=True)
        return r.returncode == 0

    assert found("[10.1.2.3]:30000") and found("[10.1.2.3]:2222") and found("10.1.2.3")
    assert not found("[10.1.2.4]:30000") and not found("10.1.2.30")


def test_user_key_id() -> None:
    assert user_key_id(organization="o", user="u", cluster="c") == "gpuclusters:o/u:c"
    assert user_key_id(organization="o", user="u", cluster="c", node="n1") == (
        "gpuclusters:o/u:c/n1"
    )
