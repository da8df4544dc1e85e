"""OpenSSH on a cluster's nodes: how users log in from their own machines.

Every Slurm cluster's login node, and each of its GPU nodes, runs Debian's
``sshd`` as a supervised daemon listening on the node's own address; users
reach the login node through the gateway's SSH port and compute nodes
through the login node (``ssh -J``). Everything sshd reads is ours, under
``/etc/gpuclusters/ssh`` (the node's ``/etc`` overlays the host's, whose
``/etc/ssh`` host keys must never be shared by nodes):

* a host key of the node's own (Ed25519, made once, kept across reboots,
  gone with a reprovision) and its certificate from the organization's host
  CA, naming the node's hostname and address (and the gateway's public host
  on the login node), renewed a month before it ends or when a name changes;
* ``user_ca.pub``: the organization's user CA (``TrustedUserCAKeys``), so a
  short-lived certificate whose principal is the account logs in with no
  key registered anywhere;
* ``principals/<account>`` (``AuthorizedPrincipalsFile``) holding the
  account's own name, and ``authorized_keys/<account>``
  (``AuthorizedKeysFile``) with the keys the member registered: present
  exactly for current members. Revoking a key or a member rewrites these
  files (the access sync) and the next login is refused; no
  ``~/.ssh/authorized_keys`` is ever read.

Root never logs in (``PermitRootLogin no``; no principal file for root).
PAM runs for every session (``UsePAM yes``): accounts made by ``useradd``
have a locked password, which sshd without PAM refuses even for keys. On
compute nodes the account stack adds ``pam_slurm_adopt``: a user with no
job on the node is refused, and a session of a user with a job is adopted
into it (``action_adopt_failure=allow``: with ``proctrack/linuxproc`` there
is no cgroup to move the session into).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from gpuclusters.core import sshca
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.base import LayerError, SshAccess

log = logging.getLogger(__name__)

SSHD = "sshd"
SSHD_BIN = "/usr/sbin/sshd"
SSH_PORT = 22
CONF_DIR = "/etc/gpuclusters/ssh"
CONFIG = f"{CONF_DIR}/sshd_config"
HOST_KEY = f"{CONF_DIR}/ssh_host_ed25519_key"
HOST_CERT = f"{HOST_KEY}-cert.pub"
USER_CA = f"{CONF_DIR}/user_ca.pub"
PRINCIPALS_DIR = f"{CONF_DIR}/principals"
KEYS_DIR = f"{CONF_DIR}/authorized_keys"
PAM_FILE = "/etc/pam.d/sshd"
HOST_CERT_VALIDITY = timedelta(days=365)
HOST_CERT_RENEW = timedelta(days=30)
MANAGED = "# Managed by gpuclusters (layers/ssh.py); changes are overwritten.\n"


def sshd_config(address: str) -> str:
    return MANAGED + "\n".join(
        [
            f"ListenAddress {address}:{SSH_PORT}",
            f"HostKey {HOST_KEY}",
            f"HostCertificate {HOST_CERT}",
            f"TrustedUserCAKeys {USER_CA}",
            f"AuthorizedPrincipalsFile {PRINCIPALS_DIR}/%u",
            f"AuthorizedKeysFile {KEYS_DIR}/%u",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "HostbasedAuthentication no",
            "PermitRootLogin no",
            "UsePAM yes",
            "PermitUserEnvironment no",
            "X11Forwarding no",
            "AllowTcpForwarding yes",
            "PrintMotd no",
            "AcceptEnv LANG LC_*",
            "ClientAliveInterval 60",
            # The daemon is supervised by pidfile of our own (NodeShell.spawn).
            "PidFile none",
            "Subsystem sftp internal-sftp",
            "",
        ]
    )


def pam_config(*, adopt_as: str | None) -> str:
    """sshd's PAM stack: public keys and certificates only (``auth`` denies
    everything else), account checks, and on compute nodes
    ``pam_slurm_adopt`` for the Slurm node ``adopt_as`` (dynamic nodes are
    in no slurm.conf, so the module must be told its node's name)."""
    lines = [
        MANAGED.rstrip("\n"),
        "auth       required     pam_deny.so",
        "account    required     pam_nologin.so",
        "account    required     pam_unix.so",
    ]
    if adopt_as is not None:
        lines.append(
            "account    required     pam_slurm_adopt.so action_no_jobs=deny "
            "action_unknown=newest action_adopt_failure=allow action_generic_failure=deny "
            f"nodename={adopt_as}"
        )
    lines += [
        "session    required     pam_unix.so",
        "session    optional     pam_env.so readenv=1 envfile=/etc/default/locale",
        "session    required     pam_limits.so",
        "",
    ]
    return "\n".join(lines)


def host_principals(shell: NodeShell, extra: Iterable[str] = ()) -> list[str]:
    return list(dict.fromkeys([shell.hostname, shell.address, *extra]))


def cert_is_good(
    cert: str,
    *,
    ca_public: str,
    principals: Sequence[str],
    now: datetime,
    key_id: str | None = None,
) -> bool:
    """Whether a node's host certificate still serves: signed by this CA,
    naming exactly these principals (and, given, for this key id: the key
    it certifies), not ending within a month."""
    try:
        info = sshca.inspect_certificate(cert)
    except sshca.SshKeyError:
        return False
    return (
        info.is_host
        and (key_id is None or info.key_id == key_id)
        and info.signed_by.split()[:2] == ca_public.split()[:2]
        and sorted(info.principals) == sorted(principals)
        and info.valid_before - now > HOST_CERT_RENEW
    )


async def _host_key(shell: NodeShell) -> str:
    """The node's host public key, made the first time."""
    private = await shell.read_file(HOST_KEY)
    if private is not None:
        try:
            return sshca.public_of(private.decode())
        except (ValueError, sshca.SshKeyError):
            log.warning("%s: unreadable SSH host key; making a new one", shell.hostname)
    pair = sshca.new_keypair()
    await shell.write_file(HOST_KEY, pair.private_openssh.encode(), mode=0o600)
    return pair.public_openssh


async def _host_cert(shell: NodeShell, access: SshAccess, principals: list[str]) -> bool:
    """Sign (again) the host key where needed; True if the file changed."""
    public = await _host_key(shell)
    ca_public = sshca.public_of(access.host_ca_private_key)
    key_id = f"host:{shell.hostname}:{_key_tag(public)}"
    have = await shell.read_file(HOST_CERT)
    if have is not None and cert_is_good(
        have.decode(),
        ca_public=ca_public,
        principals=principals,
        now=datetime.now(UTC),
        key_id=key_id,
    ):
        return False
    cert = sshca.sign_host_key(
        ca_private=access.host_ca_private_key,
        public_key=public,
        principals=principals,
        key_id=key_id,
        valid_for=HOST_CERT_VALIDITY,
    )
    return await shell.write_file(HOST_CERT, (cert + "\n").encode())


def _key_tag(public: str) -> str:
    # Ties a certificate to the key it certifies (a remade key needs a new one).
    return sshca.fingerprint(public).removeprefix("SHA256:")[:16]


async def sync_access(shell: NodeShell, access: SshAccess) -> bool:
    """Principals and authorized keys of exactly the allowed accounts;
    files of anyone else are removed. True if anything changed."""
    changed = False
    allowed = dict(access.authorized_keys)
    for account, keys in sorted(allowed.items()):
        changed |= await shell.write_file(f"{PRINCIPALS_DIR}/{account}", f"{account}\n".encode())
        text = "".join(f"{k}\n" for k in keys)
        changed |= await shell.write_file(f"{KEYS_DIR}/{account}", text.encode())
    listed = await shell.run(
        ["find", PRINCIPALS_DIR, KEYS_DIR, "-mindepth", "1", "-maxdepth", "1", "-printf", "%p\n"],
        check=False,
    )
    stale = [
        path
        for path in listed.stdout.split()
        if path.rsplit("/", 1)[-1] not in allowed and path.startswith(CONF_DIR + "/")
    ]
    if stale:
        await shell.run(["rm", "-f", "--", *stale])
        changed = True
    return changed


async def ensure_sshd(
    shell: NodeShell,
    access: SshAccess,
    *,
    extra_names: Sequence[str] = (),
    adopt: bool = False,
) -> None:
    """sshd on the node with our configuration, host certificate, user CA
    and the allowed accounts; restarted when a file it reads at start
    changed. Idempotent."""
    principals = host_principals(shell, extra_names)
    changed = await _host_cert(shell, access, principals)
    changed |= await shell.write_file(USER_CA, (access.user_ca_public_key.strip() + "\n").encode())
    changed |= await shell.write_file(CONFIG, sshd_config(shell.address).encode())
    await shell.write_file(
        PAM_FILE, pam_config(adopt_as=shell.hostname if adopt else None).encode()
    )
    await sync_access(shell, access)
    # Privilege separation directory on the node's own /run (a tmpfs).
    await shell.run(["install", "-d", "-m", "0755", "/run/sshd"])
    if changed and await shell.is_running(SSHD):
        check = await shell.run([SSHD_BIN, "-t", "-f", CONFIG], check=False)
        if check.returncode != 0:
            raise LayerError(f"{shell.hostname}: sshd refuses its configuration: {check.stderr}")
        log.info("%s: restarting sshd (its configuration changed)", shell.hostname)
        await shell.stop(SSHD)
    await shell.spawn(SSHD, [SSHD_BIN, "-D", "-e", "-f", CONFIG])
