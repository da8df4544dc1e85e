"""Unix accounts for project members on cluster nodes.

Every member gets the same name and uid on every node of every cluster, so
jobs run as the user and files on the shared volume keep their owner. Homes
are ``/home/<name>``: on Slurm clusters ``/home`` is the shared volume
(persistent), elsewhere it is node-local. Idempotent: existing accounts with
the right uid are left alone; a name held by another uid is an error (it
would hand one user another's files).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.base import PermanentLayerError, UnixUser


def _passwd_uids(passwd: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out[parts[0]] = int(parts[2])
    return out


async def ensure_accounts(
    shell: NodeShell, users: Iterable[UnixUser], *, create_homes: bool = True
) -> list[str]:
    """Create missing accounts (and their homes); return the names created.

    The group and the user are made in two steps, each skipped when already
    done, so an attempt cut short (a killed server, a timeout) is finished by
    the next one instead of failing on "group exists" forever."""
    users = list(users)
    existing = _passwd_uids((await shell.read_file("/etc/passwd") or b"").decode())
    groups = _passwd_uids((await shell.read_file("/etc/group") or b"").decode())
    created = []
    for user in users:
        have = existing.get(user.name)
        if have == user.uid:
            continue
        if have is not None:
            raise PermanentLayerError(
                f"{shell.hostname}: account {user.name} exists with uid {have}, not {user.uid}"
            )
        gid = groups.get(user.name)
        if gid is None:
            await shell.run(["groupadd", "--gid", str(user.uid), user.name])
        elif gid != user.uid:
            raise PermanentLayerError(
                f"{shell.hostname}: group {user.name} exists with gid {gid}, not {user.uid}"
            )
        await shell.run(
            [
                "useradd",
                "--uid", str(user.uid),
                "--gid", str(user.uid),
                "--home-dir", f"/home/{user.name}",
                "--no-create-home",
                "--shell", "/bin/bash",
                user.name,
            ]
        )  # fmt: skip
        created.append(user.name)
    if create_homes:
        for user in users:
            # install -d is idempotent and never touches an existing home's content.
            await shell.run(
                ["install", "-d", "-m", "0750", "-o", str(user.uid), "-g", str(user.uid),
                 f"/home/{user.name}"]
            )  # fmt: skip
    return created
