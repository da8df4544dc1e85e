"""What a node's /etc and /var start from, so that nothing of the host's
accounts, secrets or data shows through them.

A node's /etc is an overlay over the node image's /etc (linux/nodeimage.py),
or the host's where no image was built (the packages' own configuration:
PAM, alternatives, the linker cache, CA certificates; "the host's" below
means whichever it is), and
its /var an overlay over a per-provider skeleton, never over the host's
/var. Before a node's overlays are mounted, its /etc upper layer gets:

* **its own account files**: ``passwd``, ``group``, ``shadow`` and
  ``gshadow`` holding only the host's *system* accounts (Debian's system
  ranges: ids below 1000, the globally allocated 60000-64999, e.g. slurm's
  64030, and nobody/nogroup: the packages' daemon users, which the node's
  daemons run as) with every password field locked. A host login (``debian``, the
  operator's own account) is not an account of any node, so a project
  member of the same name gets one there with the uid the project gave, and
  no host password hash is readable in a node;
* **whiteouts** (overlayfs' ``0:0`` character devices) over the host's
  secrets in /etc (:data:`SECRET_PATTERNS`: SSH host keys, TLS private
  keys, the backup account files, munge and Kerberos keys...), and opaque
  directories where the node keeps its own (``/etc/gpuclusters``).

Over the host's /etc this is a deny list; over the image's, which holds no
secret, a second guard (docs/security.md). The /var skeleton holds
only Debian's top-level /var directories and the ``/var/run`` and
``/var/lock`` links; daemons make their own directories below it, as on a
fresh machine.

Blocking file work; callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

HOST_ETC = Path("/etc")
# Debian's system account ids (policy 9.2.2): 0-999 (SYS_UID_MAX = 999),
# the globally allocated 60000-64999 (slurm is 64030), and nobody/nogroup
# (65534). Users (our project members among them) are 1000-59999.
SYSTEM_ID_MAX = 999
GLOBAL_SYSTEM_IDS = range(60000, 65000)
NOBODY_ID = 65534
# Globs, relative to /etc, of host files no node may read.
SECRET_PATTERNS = (
    "passwd-",
    "group-",
    "shadow-",
    "gshadow-",
    "subuid",
    "subuid-",
    "subgid",
    "subgid-",
    "ssh/ssh_host_*_key",
    "ssl/private",
    "munge/munge.key",
    "mysql/debian.cnf",
    "krb5.keytab",
    "ipsec.secrets",
    "wireguard",
    "letsencrypt",
    "NetworkManager/system-connections",
    "security/opasswd",
    "kubernetes",
    "gpuclusters-host",
)
# /etc directories the node has its own of: the host's contents never show.
OPAQUE_DIRS = ("gpuclusters",)
ACCOUNT_FILES = ("passwd", "group", "shadow", "gshadow")
VAR_DIRS = {
    "backups": 0o755,
    "cache": 0o755,
    "lib": 0o755,
    "local": 0o2775,
    "log": 0o755,
    "mail": 0o2775,
    "opt": 0o755,
    "spool": 0o755,
    "tmp": 0o1777,
}
VAR_LINKS = {"run": "/run", "lock": "/run/lock"}


def _system(id_field: str) -> bool:
    try:
        value = int(id_field)
    except ValueError:
        return False
    return value <= SYSTEM_ID_MAX or value in GLOBAL_SYSTEM_IDS or value == NOBODY_ID


def _lines(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def node_accounts(passwd: str, group: str) -> dict[str, str]:
    """The node's account files, from the host's ``passwd`` and ``group``:
    system accounts only, every password locked. Group member lists keep
    system accounts only too."""
    users = [f for f in _lines(passwd) if len(f) >= 7 and _system(f[2])]
    names = {f[0] for f in users}
    groups = [f for f in _lines(group) if len(f) >= 4 and _system(f[2])]
    out_passwd = [":".join([f[0], "x", *f[2:7]]) for f in users]
    out_group = []
    out_gshadow = []
    for f in groups:
        members = ",".join(m for m in f[3].split(",") if m in names)
        out_group.append(":".join([f[0], "x", f[2], members]))
        out_gshadow.append(f"{f[0]}:!::{members}")
    # Locked ("*"), never expiring: no node account has a password.
    out_shadow = [f"{f[0]}:*:19000:0:99999:7:::" for f in users]
    return {
        "passwd": "".join(line + "\n" for line in out_passwd),
        "group": "".join(line + "\n" for line in out_group),
        "shadow": "".join(line + "\n" for line in out_shadow),
        "gshadow": "".join(line + "\n" for line in out_gshadow),
    }


def _group_id(group: str, name: str) -> int | None:
    for f in _lines(group):
        if len(f) >= 3 and f[0] == name and f[2].isdigit():
            return int(f[2])
    return None


def _whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _is_whiteout(path: Path) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)


def prepare_etc(upper: Path, *, host_etc: Path = HOST_ETC) -> None:
    """Fill a node's /etc upper layer (before its overlay is mounted). Files
    the node has made or changed since (its accounts, a key it wrote over a
    whiteout) are kept: this only adds what is missing."""
    upper.mkdir(parents=True, exist_ok=True)
    if not all((upper / name).exists() for name in ACCOUNT_FILES):
        accounts = node_accounts(
            (host_etc / "passwd").read_text(), (host_etc / "group").read_text()
        )
        shadow_gid = _group_id((host_etc / "group").read_text(), "shadow")
        for name, text in accounts.items():
            path = upper / name
            if not path.exists():
                path.write_text(text)
                if name in ("shadow", "gshadow"):
                    # As Debian has them: root:shadow 0640 (unix_chkpwd is
                    # setgid shadow).
                    os.chown(path, 0, shadow_gid if shadow_gid is not None else 0)
                    path.chmod(0o640)
                else:
                    path.chmod(0o644)
    for pattern in SECRET_PATTERNS:
        for host_path in host_etc.glob(pattern):
            mine = upper / host_path.relative_to(host_etc)
            if not os.path.lexists(mine) and not _any_parent_hidden(upper, mine):
                _whiteout(mine)
    for name in OPAQUE_DIRS:
        d = upper / name
        d.mkdir(parents=True, exist_ok=True)
        os.setxattr(d, "trusted.overlay.opaque", b"y")


def _any_parent_hidden(upper: Path, path: Path) -> bool:
    parent = path.parent
    while parent != upper and parent != parent.parent:
        if _is_whiteout(parent):
            return True
        parent = parent.parent
    return False


def ensure_var_skeleton(path: Path) -> Path:
    """The lower layer of every node's /var (made once, idempotent)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, mode in VAR_DIRS.items():
        d = path / name
        d.mkdir(exist_ok=True)
        d.chmod(mode)
    for name, target in VAR_LINKS.items():
        link = path / name
        if not link.is_symlink():
            link.symlink_to(target)
    return path
