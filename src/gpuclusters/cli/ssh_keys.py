"""``gpuclusters ssh-keys ...`` (add, list, delete), and the SSH plumbing
that ``gpuclusters clusters ssh`` shares with it.

Registered keys let you log in with your own ssh (your key, as your own
Unix account on every cluster of your projects). ``ssh-keys add`` also
writes the organization's ``@cert-authority`` line into the CLI's own
known_hosts file, ``$GPUCLUSTERS_HOME/known_hosts``, so ssh recognises the
clusters' host certificates: ``ssh -o UserKnownHostsFile=<that file> -p
PORT USER@HOST``. The file holds only lines the CLI manages (one per
gateway host, replaced when it changes); nothing touches ``~/.ssh``.

``clusters ssh`` needs no registered key: :func:`certificate_login` makes
a throwaway Ed25519 key in a private temporary directory, has the server
sign it (a short-lived certificate), and runs the system ``ssh`` with it
(:func:`ssh_argv`, a pure function); the key is removed when ssh exits.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.text import Text

from gpuclusters.cli.context import (
    OutputFormat,
    OutputOpt,
    api_command,
    open_client,
    stderr_console,
)
from gpuclusters.cli.render import age, emit, print_json, table
from gpuclusters.client import Client
from gpuclusters.core import sshca
from gpuclusters.core.clientconfig import default_home, replace_atomically
from gpuclusters.core.models import SshCertificate, SshKey

app = typer.Typer(
    help="Your SSH public keys: log in to clusters with your own ssh and key.",
    no_args_is_help=True,
)

KNOWN_HOSTS_FILE = "known_hosts"
CA_MARKER = "@cert-authority"
SSH_PORT = 22


# --- the CLI's known_hosts file ----------------------------------------------------------


def known_hosts_path(home: Path | None = None) -> Path:
    """``$GPUCLUSTERS_HOME/known_hosts``: the CLI's own known_hosts file."""
    return (home or default_home()) / KNOWN_HOSTS_FILE


def _ca_patterns(line: str) -> str | None:
    parts = line.split()
    if len(parts) >= 4 and parts[0] == CA_MARKER:
        return parts[1]
    return None


def ca_key_of(known_hosts_line: str) -> str:
    """The CA public key (``"<type> <base64>"``) of an ``@cert-authority`` line."""
    parts = known_hosts_line.split()
    if len(parts) < 4 or parts[0] != CA_MARKER:
        raise ValueError("not an @cert-authority known_hosts line")
    return f"{parts[2]} {parts[3]}"


def merge_known_hosts(text: str, line: str) -> str:
    """``text`` with ``line`` in place of the ``@cert-authority`` line(s)
    for the same host patterns (a new CA or comment replaces the old), or
    added at the end; every other line is kept as it is."""
    line = line.strip()
    patterns = _ca_patterns(line)
    if patterns is None:
        raise ValueError("not an @cert-authority known_hosts line")
    out: list[str] = []
    placed = False
    for old in text.splitlines():
        if _ca_patterns(old) == patterns:
            if not placed:
                out.append(line)
                placed = True
            continue
        out.append(old)
    if not placed:
        out.append(line)
    return "\n".join(out) + "\n"


def write_known_hosts(line: str, path: Path | None = None) -> Path:
    """Put ``line`` into the CLI's known_hosts file (atomically; unchanged
    files are not rewritten). Returns the file's path."""
    path = path or known_hosts_path()
    try:
        old = path.read_text()
    except FileNotFoundError:
        old = ""
    new = merge_known_hosts(old, line)
    if new == old:
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    replace_atomically(path, new.encode(), 0o644)
    return path


# --- the ssh command line ----------------------------------------------------------------


def ssh_file_value(path: Path | str) -> str:
    """A file name as an ``-o Option=VALUE`` of ssh: ``%`` doubled (ssh
    expands %-tokens in file names) and double-quoted when it holds blanks,
    quotes or ``#`` (ssh splits option lines like a shell)."""
    value = str(path).replace("%", "%%")
    if any(c.isspace() or c in "\"'\\#" for c in value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def identity_options(key: Path, certificate: Path, known_hosts: Sequence[Path]) -> list[str]:
    """Use only this key and certificate; trust only hosts the known_hosts
    files vouch for (never ask, never add); show errors only."""
    # ``-i`` takes the file name as is (ssh checks it exists before any
    # expansion), so the key must live in a plainly named directory
    # (:func:`certificate_login` sees to that).
    return [
        "-i",
        str(key),
        "-o",
        f"CertificateFile={ssh_file_value(certificate)}",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "UserKnownHostsFile=" + " ".join(ssh_file_value(p) for p in known_hosts),
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "LogLevel=ERROR",
    ]


def ssh_argv(
    *,
    ssh: str,
    key: Path,
    certificate: Path,
    known_hosts: Sequence[Path],
    user: str,
    host: str,
    port: int,
    command: Sequence[str] = (),
    tty: bool = False,
    node_host: str | None = None,
    node_port: int = SSH_PORT,
) -> list[str]:
    """The system ssh's command line for a login as ``user`` on
    ``host:port`` (the cluster's login node behind the gateway), or, with
    ``node_host``, on that node reached through the login node.

    ``command`` travels as one string quoted with ``shlex.join``, so the
    remote shell hands the arguments over exactly as given. ``--`` ends
    ssh's options before the destination. The jump to a node is a
    ProxyCommand (``ssh -W %h:%p``) with the same key, certificate and
    known_hosts options: ProxyJump would not pass command-line options on
    to the jump. Its words are shell-quoted (ssh runs it with ``sh -c``)
    and their ``%`` doubled (ssh expands %-tokens in it)."""
    options = identity_options(key, certificate, known_hosts)
    remote = [shlex.join(command)] if command else []
    terminal = ["-t"] if tty and not command else []
    if node_host is None:
        return [ssh, *options, *terminal, "-p", str(port), "--", f"{user}@{host}", *remote]
    jump = [ssh, *options, "-p", str(port), "--", f"{user}@{host}"]
    proxy = " ".join(
        [
            shlex.quote(ssh).replace("%", "%%"),
            "-W",
            "%h:%p",
            *(shlex.quote(word).replace("%", "%%") for word in jump[1:]),
        ]
    )
    return [
        ssh,
        *options,
        "-o",
        f"ProxyCommand={proxy}",
        *terminal,
        "-p",
        str(node_port),
        "--",
        f"{user}@{node_host}",
        *remote,
    ]


def _plain_tmp() -> str:
    """The temporary directory, unless its name holds characters ssh would
    expand in ``-i`` (``%``, ``$``, ``~``) or split on; then /tmp."""
    base = tempfile.gettempdir()
    return base if re.fullmatch(r"[A-Za-z0-9_./-]+", base) else "/tmp"


def _write_private(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_ssh(argv: Sequence[str]) -> int:
    """Run ssh with this process's stdin, stdout and stderr; its exit status
    (128 + N for a signal N). Ctrl-C belongs to ssh while it runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(list(argv))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return 128 - rc if rc < 0 else rc


def certificate_login(
    client: Client,
    cluster: str,
    *,
    node: str | None,
    command: Sequence[str],
    ssh: str | None = None,
    known_hosts: Path | None = None,
    node_port: int = SSH_PORT,
) -> int:
    """``clusters ssh``: a throwaway key, signed by the server for the
    caller's account, used by the system ssh; returns ssh's exit status.
    The key lives in a private (0700) temporary directory removed when ssh
    exits; the CA line goes into the CLI's known_hosts file."""
    ssh = ssh or shutil.which("ssh")
    if ssh is None:
        raise typer.BadParameter("ssh is not installed here (install openssh-client)")
    known_hosts = known_hosts or known_hosts_path()
    with tempfile.TemporaryDirectory(prefix="gpuclusters-ssh-", dir=_plain_tmp()) as tmp:
        os.chmod(tmp, 0o700)
        directory = Path(tmp)
        pair = sshca.new_keypair(comment=f"gpuclusters-{cluster}")
        key = directory / "id_ed25519"
        _write_private(key, pair.private_openssh, 0o600)
        cert: SshCertificate = client.clusters.ssh_certificate(
            cluster, public_key=pair.public_openssh, node=node
        )
        certificate = directory / "id_ed25519-cert.pub"
        _write_private(certificate, cert.certificate.strip() + "\n", 0o644)
        files = [write_known_hosts(cert.known_hosts, known_hosts)]
        if cert.node_host is not None:
            # The node is reached by its name inside the cluster: trust the
            # same host CA for that name, for this session only.
            node_file = directory / "known_hosts"
            node_line = sshca.known_hosts_line(
                ca_key_of(cert.known_hosts),
                [sshca.host_pattern(cert.node_host, node_port)],
                f"gpuclusters:{cluster}",
            )
            _write_private(node_file, node_line + "\n", 0o644)
            files.append(node_file)
        argv = ssh_argv(
            ssh=ssh,
            key=key,
            certificate=certificate,
            known_hosts=files,
            user=cert.user,
            host=cert.host,
            port=cert.port,
            command=command,
            tty=not command and sys.stdin.isatty(),
            node_host=cert.node_host,
            node_port=node_port,
        )
        return run_ssh(argv)


# --- commands ----------------------------------------------------------------------------


def keys_table(keys: Sequence[SshKey]) -> RenderableType:
    t = table("ID", "NAME", "TYPE", "FINGERPRINT", "AGE")
    for k in keys:
        t.add_row(k.id, k.name or "-", k.key_type, k.fingerprint, age(k.created_at))
    return t


def read_public_key(source: str) -> str:
    """The key line from a file, or from stdin for ``-``. A private key is
    refused here: it must never leave this machine."""
    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not a text file"
            raise typer.BadParameter(f"cannot read {path}: {reason}") from exc
    if "PRIVATE KEY" in text:
        hint = ""
        if source != "-" and Path(f"{source}.pub").expanduser().exists():
            hint = f"; the public key is {source}.pub"
        raise typer.BadParameter(
            f"{'stdin' if source == '-' else source} holds a private key, which never "
            f"leaves this machine: give the public key (the .pub file){hint}"
        )
    return text


@app.command("add")
@api_command
def add(
    source: Annotated[
        str, typer.Argument(metavar="FILE|-", help="public key file (e.g. ~/.ssh/id_ed25519.pub)")
    ],
    *,
    name: Annotated[
        str | None,
        typer.Option("--name", help="a label (default: the key's comment)", show_default=False),
    ] = None,
    trust_in_ssh: Annotated[
        bool,
        typer.Option(
            "--known-hosts/--no-known-hosts",
            help="also trust the clusters' host CA in ~/.ssh/known_hosts, so plain ssh "
            "asks no question (one @cert-authority line for the gateway, replaced in place)",
        ),
    ] = True,
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Register a public key for logging in with your own ssh, and trust the
    clusters' host certificates in $GPUCLUSTERS_HOME/known_hosts (and in
    ~/.ssh/known_hosts unless --no-known-hosts)."""
    text = read_public_key(source)
    with open_client() as client:
        key = client.ssh_keys.add(text, name=name)
        ca = client.ssh_keys.ca()
        user = client.whoami().user
    path = write_known_hosts(ca.known_hosts)
    trusted = [path]
    if trust_in_ssh:
        trusted.append(write_known_hosts(ca.known_hosts, Path.home() / ".ssh" / KNOWN_HOSTS_FILE))
    connect = shlex.join(["ssh", "-p", "PORT"])
    lines = [
        f"added {key.key_type} key {key.fingerprint}" + (f" ({key.name})" if key.name else ""),
        f"trusted the clusters' host certificates on {ca.gateway_host} in "
        + " and ".join(str(p) for p in trusted),
        f"connect with: {connect} {user}@{ca.gateway_host}"
        + ("" if trust_in_ssh else f" -o UserKnownHostsFile={path}"),
        "  (PORT: the port of the cluster's ssh_endpoint, see `gpuclusters clusters get NAME "
        "-o json`; or simply: gpuclusters clusters ssh NAME)",
    ]
    if output is OutputFormat.JSON:
        print_json(key)
        for line in lines:
            stderr_console().print(Text(line), soft_wrap=True)
    else:
        for line in lines:
            typer.echo(line)


@app.command("list")
@api_command
def list_(output: OutputOpt = OutputFormat.TABLE) -> None:
    """List your SSH keys."""
    with open_client() as client:
        keys = client.ssh_keys.list()
    emit(output, keys, render=lambda: keys_table(keys), empty="no SSH keys")


@app.command("delete")
@api_command
def delete(
    key: Annotated[str, typer.Argument(metavar="ID", help="key id or fingerprint")],
    output: OutputOpt = OutputFormat.TABLE,
) -> None:
    """Delete one of your SSH keys (clusters stop accepting it shortly)."""
    with open_client() as client:
        keys = client.ssh_keys.list()
        client.ssh_keys.delete(key)
    ref = key.removeprefix("SHA256:")
    gone = next(
        (k for k in keys if key == k.id or k.fingerprint.removeprefix("SHA256:") == ref), None
    )
    if output is OutputFormat.JSON:
        if gone is not None:
            print_json(gone)
        return
    typer.echo(f"ssh key {gone.fingerprint if gone else key} deleted")
