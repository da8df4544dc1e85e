"""``gpuclusters ssh-keys`` and ``gpuclusters clusters ssh``.

The ssh command line is a pure function (``cli.ssh_keys.ssh_argv``) and is
checked word by word, including the ``--node`` ProxyCommand as ssh and then
``sh`` will read it. The commands run against canned HTTP answers; ``clusters
ssh`` runs a stand-in ``ssh`` that records what it was given. Where this
machine has OpenSSH's sshd and the tests run as root, a real sshd on a free
port (host certificate, trusted user CA, no authorized keys) checks the
whole login end to end: certificate, known_hosts on a non-22 port, exit
status, stdin, argument quoting and the jump to a node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from gpuclusters.cli import ssh_keys
from gpuclusters.client import Client
from gpuclusters.core import sshca
from support.cli import install_fake_api, isolate_env, ok, run
from support.fake_api import FakeApi

T0 = "2025-01-01T00:00:00Z"
KEY = Path("/tmp/gpuclusters-ssh-x/id_ed25519")
CERT = Path("/tmp/gpuclusters-ssh-x/id_ed25519-cert.pub")
KNOWN = Path("/home/a/.gpuclusters/known_hosts")
IDENTITY = [
    "-i",
    str(KEY),
    "-o",
    f"CertificateFile={CERT}",
    "-o",
    "IdentitiesOnly=yes",
    "-o",
    f"UserKnownHostsFile={KNOWN}",
    "-o",
    "StrictHostKeyChecking=yes",
    "-o",
    "LogLevel=ERROR",
]


def argv(**kwargs: Any) -> list[str]:
    base: dict[str, Any] = {
        "ssh": "/usr/bin/ssh",
        "key": KEY,
        "certificate": CERT,
        "known_hosts": [KNOWN],
        "user": "alice",
        "host": "gw.example",
        "port": 30022,
    }
    return ssh_keys.ssh_argv(**{**base, **kwargs})


# --- the ssh command line ----------------------------------------------------------------


def test_login_shell_gets_a_terminal_only_without_a_command() -> None:
    assert argv(tty=True) == [
        "/usr/bin/ssh",
        *IDENTITY,
        "-t",
        "-p",
        "30022",
        "--",
        "alice@gw.example",
    ]
    assert argv() == ["/usr/bin/ssh", *IDENTITY, "-p", "30022", "--", "alice@gw.example"]
    with_command = argv(command=["sinfo", "-N"], tty=True)
    assert "-t" not in with_command
    assert with_command[-3:] == ["--", "alice@gw.example", "sinfo -N"]


@pytest.mark.parametrize(
    "command",
    [
        ["bash", "-c", "echo 'a b' | cat"],
        ["printf", "%s\\n", "$HOME", "*", "a  b", ""],
        ["-v"],  # looks like an option of ssh: it is after "--" and the destination
        ["sh", "-c", 'echo "$1"', "sh", "it's"],
    ],
)
def test_the_command_is_one_word_that_the_remote_shell_splits_back(command: list[str]) -> None:
    line = argv(command=command)
    assert line[-3:-1] == ["--", "alice@gw.example"]
    assert shlex.split(line[-1]) == command


def _ssh_expand(template: str, *, host: str, port: int) -> str:
    """What ssh does to a ProxyCommand before ``sh -c`` runs it."""
    return re.sub(
        r"%(.)",
        lambda m: {"h": host, "p": str(port), "%": "%"}[m.group(1)],
        template,
    )


def test_node_is_reached_through_the_login_node_with_a_proxy_command() -> None:
    line = argv(node_host="demo-standard-ab12", command=["hostname"])
    proxy = [w for w in line if w.startswith("ProxyCommand=")]
    assert len(proxy) == 1 and line[line.index(proxy[0]) - 1] == "-o"
    assert line[: len(IDENTITY) + 1] == ["/usr/bin/ssh", *IDENTITY]
    assert line[-5:] == ["-p", "22", "--", "alice@demo-standard-ab12", "hostname"]
    run = _ssh_expand(proxy[0].removeprefix("ProxyCommand="), host="demo-standard-ab12", port=22)
    assert shlex.split(run) == [
        "/usr/bin/ssh",
        "-W",
        "demo-standard-ab12:22",
        *IDENTITY,
        "-p",
        "30022",
        "--",
        "alice@gw.example",
    ]


def test_awkward_file_names_survive_ssh_and_the_shell() -> None:
    known = [Path("/home/a b/100%/known_hosts"), Path("/tmp/x/known_hosts")]
    cert = Path("/home/a b/it's#1/cert.pub")
    line = argv(known_hosts=known, certificate=cert, node_host="n1")
    assert f"CertificateFile={ssh_keys.ssh_file_value(cert)}" in line
    assert ssh_keys.ssh_file_value(cert) == '"/home/a b/it\'s#1/cert.pub"'
    assert ssh_keys.ssh_file_value(known[0]) == '"/home/a b/100%%/known_hosts"'
    assert 'UserKnownHostsFile="/home/a b/100%%/known_hosts" /tmp/x/known_hosts' in line
    proxy = next(w for w in line if w.startswith("ProxyCommand="))
    words = shlex.split(_ssh_expand(proxy.removeprefix("ProxyCommand="), host="n1", port=22))
    # The jump's own ssh gets the very same option values.
    assert words[3:] == [*line[1 : len(IDENTITY) + 1], "-p", "30022", "--", "alice@gw.example"]


# --- the CLI's known_hosts file ----------------------------------------------------------


def test_known_hosts_lines_are_replaced_per_host_patterns(tmp_path: Path) -> None:
    a1 = "@cert-authority [gw]:*,gw ssh-ed25519 AAAA1 gpuclusters:acme"
    a2 = "@cert-authority [gw]:*,gw ssh-ed25519 AAAA2 gpuclusters:acme"
    b = "@cert-authority [other]:*,other ssh-ed25519 BBBB gpuclusters:x"
    assert ssh_keys.merge_known_hosts("", a1) == a1 + "\n"
    text = f"# mine\n{a1}\nhost.example ssh-ed25519 CCCC\n"
    assert ssh_keys.merge_known_hosts(text, a2) == f"# mine\n{a2}\nhost.example ssh-ed25519 CCCC\n"
    assert ssh_keys.merge_known_hosts(text, b) == text + b + "\n"
    assert ssh_keys.merge_known_hosts(f"{a1}\n{a1}\n", a2) == a2 + "\n"
    with pytest.raises(ValueError):
        ssh_keys.merge_known_hosts("", "gw ssh-ed25519 AAAA")
    assert ssh_keys.ca_key_of(a1) == "ssh-ed25519 AAAA1"

    path = tmp_path / "home" / "known_hosts"
    assert ssh_keys.write_known_hosts(a1, path) == path
    assert path.read_text() == a1 + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    before = path.stat().st_mtime_ns
    ssh_keys.write_known_hosts(a1, path)
    assert path.stat().st_mtime_ns == before  # unchanged: not rewritten
    ssh_keys.write_known_hosts(a2, path)
    assert path.read_text() == a2 + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["known_hosts"]


# --- ssh-keys commands -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))  # ~/.ssh/known_hosts is written


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    return install_fake_api(monkeypatch)


def key_json(pub: str, name: str = "laptop", key_id: str = "k1") -> dict[str, Any]:
    return {
        "id": key_id,
        "name": name,
        "key_type": pub.split()[0],
        "fingerprint": sshca.fingerprint(pub),
        "public_key": " ".join(pub.split()[:2]),
        "created_at": T0,
    }


HOST_CA = sshca.new_keypair("host-ca")
CA_LINE = sshca.known_hosts_line(
    HOST_CA.public_openssh, ["[gw.example]:*", "gw.example"], "gpuclusters:default"
)
CA_JSON = {
    "user_ca_public_key": "ssh-ed25519 AAAAuser",
    "host_ca_public_key": HOST_CA.public_openssh,
    "gateway_host": "gw.example",
    "known_hosts": CA_LINE,
}
WHOAMI = {"user": "alice", "organization": "default", "is_admin": False, "projects": {}}


def _serve_add(api: FakeApi, pub: str) -> None:
    api.on("POST", "/v1/ssh-keys", ok(key_json(pub), 201))
    api.on("GET", "/v1/ssh-ca", ok(CA_JSON))
    api.on("GET", "/v1/whoami", ok(WHOAMI))


def test_add_reads_the_file_writes_known_hosts_and_says_how_to_connect(
    api: FakeApi, tmp_path: Path
) -> None:
    pub = sshca.new_keypair("alice@laptop").public_openssh
    (tmp_path / "id.pub").write_text(pub + "\n")
    _serve_add(api, pub)
    result = run("ssh-keys", "add", str(tmp_path / "id.pub"), "--name", "laptop")
    assert result.exit_code == 0, result.output
    sent = json.loads(api.requests[0].content)
    assert sent == {"public_key": pub + "\n", "name": "laptop"}
    known = tmp_path / "home" / "known_hosts"
    assert known.read_text() == CA_LINE + "\n"
    # Plain ssh trusts the gateway's host CA too: one line, kept beside others.
    ssh_known = tmp_path / "user" / ".ssh" / "known_hosts"
    assert ssh_known.read_text() == CA_LINE + "\n"
    assert sshca.fingerprint(pub) in result.stdout
    assert "ssh -p PORT alice@gw.example" in result.stdout


def test_add_can_leave_ssh_known_hosts_alone(api: FakeApi, tmp_path: Path) -> None:
    pub = sshca.new_keypair().public_openssh
    _serve_add(api, pub)
    ssh_known = tmp_path / "user" / ".ssh" / "known_hosts"
    ssh_known.parent.mkdir(parents=True)
    ssh_known.write_text("old.example ssh-ed25519 AAAA\n")
    result = run("ssh-keys", "add", "-", "--no-known-hosts", stdin=pub + "\n")
    assert result.exit_code == 0, result.output
    assert ssh_known.read_text() == "old.example ssh-ed25519 AAAA\n"
    known = tmp_path / "home" / "known_hosts"
    assert f"-o UserKnownHostsFile={known}" in result.stdout
    # Without the flag the line is added and the user's own entries stay.
    _serve_add(api, pub)
    assert run("ssh-keys", "add", "-", stdin=pub + "\n").exit_code == 0
    assert ssh_known.read_text() == "old.example ssh-ed25519 AAAA\n" + CA_LINE + "\n"


def test_add_from_stdin_with_json_output(api: FakeApi) -> None:
    pub = sshca.new_keypair().public_openssh
    _serve_add(api, pub)
    result = run("ssh-keys", "add", "-", "--output", "json", stdin=pub + "\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == key_json(pub)
    assert json.loads(api.requests[0].content) == {"public_key": pub + "\n"}
    assert "connect with: ssh -p PORT" in result.stderr  # the JSON stays clean


def test_a_private_key_never_leaves_the_machine(api: FakeApi, tmp_path: Path) -> None:
    pair = sshca.new_keypair()
    (tmp_path / "id").write_text(pair.private_openssh)
    (tmp_path / "id.pub").write_text(pair.public_openssh)
    result = run("ssh-keys", "add", str(tmp_path / "id"))
    assert result.exit_code == 2
    assert "private key" in result.stderr and f"{tmp_path / 'id'}.pub" in result.stderr
    result = run("ssh-keys", "add", "-", stdin=pair.private_openssh)
    assert result.exit_code == 2 and "private key" in result.stderr
    assert api.requests == []
    result = run("ssh-keys", "add", str(tmp_path / "missing.pub"))
    assert result.exit_code == 2 and "cannot read" in result.stderr


def test_add_shows_the_servers_rule(api: FakeApi) -> None:
    api.on(
        "POST",
        "/v1/ssh-keys",
        ok(
            {
                "code": "invalid_input",
                "message": "public_key: key type 'ssh-dss' is not accepted",
                "field": "public_key",
            },
            422,
        ),
    )
    result = run("ssh-keys", "add", "-", stdin="ssh-dss AAAA\n")
    assert result.exit_code == 1
    assert "error [invalid_input]: public_key: key type 'ssh-dss' is not accepted" in (
        result.stderr
    )
    assert "(field: public_key)" in result.stderr


def test_list_and_delete(api: FakeApi) -> None:
    pubs = [sshca.new_keypair().public_openssh for _ in range(2)]
    keys = [key_json(p, name=f"k{i}", key_id=f"id{i}") for i, p in enumerate(pubs)]
    api.on("GET", "/v1/ssh-keys", ok(keys))
    result = run("ssh-keys", "list")
    assert result.exit_code == 0, result.output
    assert "FINGERPRINT" in result.stdout and keys[1]["fingerprint"] in result.stdout
    result = run("ssh-keys", "list", "-o", "json")
    assert json.loads(result.stdout) == keys

    fp = keys[1]["fingerprint"]
    api.on("DELETE", f"/v1/ssh-keys/{fp}", httpx.Response(204))
    result = run("ssh-keys", "delete", fp, "-o", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == keys[1]
    # The fingerprint travels as one quoted path segment.
    assert api.requests[-1].url.raw_path == f"/v1/ssh-keys/{quote(fp, safe='')}".encode()
    api.on("DELETE", "/v1/ssh-keys/id0", httpx.Response(204))
    result = run("ssh-keys", "delete", "id0")
    assert (
        result.exit_code == 0
        and result.stdout.strip() == f"ssh key {keys[0]['fingerprint']} deleted"
    )
    api.on("DELETE", "/v1/ssh-keys/nope", ok({"code": "not_found", "message": "no"}, 404))
    assert run("ssh-keys", "delete", "nope").exit_code == 1


# --- clusters ssh ------------------------------------------------------------------------

FAKE_SSH = """#!{python}
import json, os, stat, sys
args = sys.argv[1:]
key = args[args.index("-i") + 1]
cert = next(a for a in args if a.startswith("CertificateFile=")).split("=", 1)[1]
record = {{
    "argv": args,
    "key_mode": stat.S_IMODE(os.stat(key).st_mode),
    "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(key)).st_mode),
    "private": open(key).read(),
    "cert": open(cert).read(),
}}
with open({out!r}, "w") as f:
    json.dump(record, f)
sys.exit(7)
"""


def _signing_reply(
    user_ca: sshca.KeyPair, *, host: str, port: int, known_hosts: str, user: str = "alice"
) -> Any:
    def reply(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        cert = sshca.sign_user_key(
            ca_private=user_ca.private_openssh,
            public_key=body["public_key"],
            principal=user,
            key_id="test",
            valid_for=timedelta(minutes=5),
        )
        return ok(
            {
                "cluster": "demo",
                "user": user,
                "principal": user,
                "certificate": cert,
                "valid_before": (datetime.now(UTC) + timedelta(minutes=5)).isoformat(),
                "host": host,
                "port": port,
                "known_hosts": known_hosts,
                "node_host": body.get("node"),
            }
        )

    return reply


def test_clusters_ssh_signs_a_throwaway_key_and_runs_ssh(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "record.json"
    fake = tmp_path / "ssh"
    fake.write_text(FAKE_SSH.format(python=sys.executable, out=str(out)))
    fake.chmod(0o755)
    monkeypatch.setattr(ssh_keys.shutil, "which", lambda name: str(fake))
    user_ca = sshca.new_keypair()
    api.on(
        "POST",
        "/v1/projects/default/clusters/demo/ssh-certificate",
        _signing_reply(user_ca, host="gw.example", port=30022, known_hosts=CA_LINE),
    )
    result = run("clusters", "ssh", "demo", "--node", "n1", "--", "bash", "-c", "echo 'a b'")
    assert result.exit_code == 7, result.output  # ssh's status is passed on
    sent = json.loads(api.requests[-1].content)
    assert sent["node"] == "n1" and sent["public_key"].startswith("ssh-ed25519 ")
    record = json.loads(out.read_text())
    args = record["argv"]
    assert record["key_mode"] == 0o600 and record["dir_mode"] == 0o700
    assert sshca.public_of(record["private"]) == " ".join(sent["public_key"].split()[:2])
    assert sshca.inspect_certificate(record["cert"]).principals == ("alice",)
    assert args[-3:-1] == ["--", "alice@n1"] and shlex.split(args[-1]) == [
        "bash",
        "-c",
        "echo 'a b'",
    ]
    assert "-t" not in args  # a command, and stdin is not a terminal
    known = tmp_path / "home" / "known_hosts"
    assert known.read_text() == CA_LINE + "\n"
    files = next(a for a in args if a.startswith("UserKnownHostsFile=")).split("=", 1)[1]
    managed, node_file = files.split()
    assert managed == str(known)
    # The key, the certificate and the node's known_hosts are gone with ssh.
    key_dir = Path(args[args.index("-i") + 1]).parent
    assert Path(node_file).parent == key_dir and not key_dir.exists()


def test_clusters_ssh_without_ssh_installed(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh_keys.shutil, "which", lambda name: None)
    result = run("clusters", "ssh", "demo")
    assert result.exit_code == 2 and "ssh is not installed" in result.stderr
    assert api.requests == []


def test_as_root_execs_the_local_command_line(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = {"cluster": "demo", "node": "demo-login", "user": "root", "argv": ["true", "x"]}
    api.on("POST", "/v1/projects/default/clusters/demo/ssh", ok(target))
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr("os.execvp", lambda f, argv: execs.append((f, list(argv))))
    result = run("clusters", "ssh", "demo", "--as-root", "--", "id")
    assert result.exit_code == 0, result.output
    assert execs == [("true", ["true", "x"])]
    assert json.loads(api.requests[-1].content) == {"command": ["id"], "as_root": True}


# --- a real sshd -------------------------------------------------------------------------

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Sshd:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.user_ca = sshca.new_keypair("user-ca")
        self.host_ca = sshca.new_keypair("host-ca")
        host = sshca.new_keypair("host")
        key = root / "host_key"
        key.write_text(host.private_openssh)
        key.chmod(0o600)
        (root / "host_key.pub").write_text(host.public_openssh + "\n")
        (root / "host_key-cert.pub").write_text(
            sshca.sign_host_key(
                ca_private=self.host_ca.private_openssh,
                public_key=host.public_openssh,
                principals=["localhost", "127.0.0.1"],
                key_id="test-host",
                valid_for=timedelta(hours=1),
            )
            + "\n"
        )
        (root / "user_ca.pub").write_text(self.user_ca.public_openssh + "\n")
        config = root / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {key}\n"
            f"HostCertificate {root / 'host_key-cert.pub'}\n"
            f"TrustedUserCAKeys {root / 'user_ca.pub'}\nAuthorizedKeysFile none\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PidFile {root / 'sshd.pid'}\nLogLevel ERROR\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation
        self.proc = subprocess.Popen(
            [SSHD or "sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"sshd exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
                )
            time.sleep(0.05)
        raise RuntimeError("sshd did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    if os.geteuid() != 0 or SSHD is None or shutil.which("ssh") is None:
        pytest.skip("needs root, sshd and ssh")
    root = tmp_path / "sshd"
    root.mkdir()
    server = Sshd(root)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def stdin_from(data: bytes) -> Iterator[None]:
    """fd 0 reads ``data`` (ssh inherits the real fd, not sys.stdin)."""
    path_r, path_w = os.pipe()
    os.write(path_w, data)
    os.close(path_w)
    saved = os.dup(0)
    os.dup2(path_r, 0)
    os.close(path_r)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def _login(
    sshd: Sshd,
    tmp_path: Path,
    command: list[str],
    *,
    node: str | None = None,
    ca_line: str | None = None,
    ssh: str | None = None,
) -> int:
    fake = FakeApi()
    line = ca_line or sshca.known_hosts_line(
        sshd.host_ca.public_openssh, ["[localhost]:*", "localhost"], "gpuclusters:test"
    )
    fake.on(
        "POST",
        "/v1/projects/default/clusters/demo/ssh-certificate",
        _signing_reply(
            sshd.user_ca, host="localhost", port=sshd.port, known_hosts=line, user="root"
        ),
    )
    with Client("http://api.test", "k", transport=httpx.MockTransport(fake)) as client:
        return ssh_keys.certificate_login(
            client,
            "demo",
            node=node,
            command=command,
            ssh=ssh,
            # ssh must read a file name with a blank, a quote and a %-token as it is.
            known_hosts=tmp_path / "my 'home' %d" / "known_hosts",
            node_port=sshd.port,
        )


def test_real_ssh_login_with_a_certificate(
    sshd: Sshd, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with stdin_from(b""):
        assert _login(sshd, tmp_path, ["bash", "-c", "echo 'a b' | cat"]) == 0
    assert capfd.readouterr().out == "a b\n"
    with stdin_from(b""):
        assert _login(sshd, tmp_path, ["sh", "-c", "exit 3"]) == 3
    with stdin_from(b"line one\nline two\n"):
        assert _login(sshd, tmp_path, ["wc", "-l"]) == 0
    assert capfd.readouterr().out.strip() == "2"
    with stdin_from(b""):
        assert _login(sshd, tmp_path, ["printf", "[%s]", "$HOME", "*", "a  b"]) == 0
    assert capfd.readouterr().out == "[$HOME][*][a  b]"


def test_real_ssh_jumps_to_a_node_through_the_login_node(
    sshd: Sshd, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The "node" is the same sshd under another name (127.0.0.1), trusted
    # only through the per-session known_hosts line; the login node is
    # "localhost". A wrapper records every ssh started: the login, and the
    # jump that the ProxyCommand starts.
    log = tmp_path / "ssh.log"
    wrapper = tmp_path / "ssh"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("ssh")} "$@"\n')
    wrapper.chmod(0o755)
    with stdin_from(b""):
        rc = _login(sshd, tmp_path, ["hostname"], node="127.0.0.1", ssh=str(wrapper))
    out = capfd.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() == socket.gethostname()
    started = log.read_text().splitlines()
    assert len(started) == 2
    assert started[0].endswith(f"-p {sshd.port} -- root@127.0.0.1 hostname")
    assert started[1].startswith("-W 127.0.0.1:") and started[1].endswith(
        f"-p {sshd.port} -- root@localhost"
    )


def test_real_ssh_refuses_a_host_signed_by_another_ca(
    sshd: Sshd, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    other = sshca.new_keypair("other-ca")
    line = sshca.known_hosts_line(
        other.public_openssh, ["[localhost]:*", "localhost"], "gpuclusters:test"
    )
    with stdin_from(b""):
        assert _login(sshd, tmp_path, ["true"], ca_line=line) == 255
    assert "host key verification failed" in capfd.readouterr().err.lower()
