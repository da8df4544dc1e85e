"""Unix accounts on nodes: idempotent, and finishing what a cut-short run
started (the group made, the user not yet)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from gpuclusters.core.nodeshell import CommandResult
from gpuclusters.layers.accounts import ensure_accounts
from gpuclusters.layers.base import PermanentLayerError, UnixUser


class FakeShell:
    """Just enough of a node: /etc/passwd, /etc/group, groupadd, useradd."""

    hostname = "n1"
    address = "10.0.0.1"

    def __init__(self, passwd: str = "root:x:0:0::/root:/bin/bash\n", group: str = "") -> None:
        self.files = {"/etc/passwd": passwd, "/etc/group": group or "root:x:0:\n"}
        self.commands: list[list[str]] = []

    async def read_file(self, path: str) -> bytes | None:
        text = self.files.get(path)
        return None if text is None else text.encode()

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        argv = list(argv)
        self.commands.append(argv)
        if argv[0] == "groupadd":
            gid, name = argv[2], argv[3]
            self.files["/etc/group"] += f"{name}:x:{gid}:\n"
        elif argv[0] == "useradd":
            uid, gid, name = argv[2], argv[4], argv[-1]
            assert f"\n{name}:x:{gid}:" in "\n" + self.files["/etc/group"], "group first"
            self.files["/etc/passwd"] += f"{name}:x:{uid}:{gid}::/home/{name}:/bin/bash\n"
        return CommandResult(0, "", "")


async def test_creates_then_is_idempotent() -> None:
    shell = FakeShell()
    users = [UnixUser("alice", 10001), UnixUser("bob", 10002)]
    assert await ensure_accounts(shell, users) == ["alice", "bob"]  # type: ignore[arg-type]
    made = [c[0] for c in shell.commands]
    assert made.count("groupadd") == 2 and made.count("useradd") == 2
    shell.commands.clear()
    assert await ensure_accounts(shell, users) == []  # type: ignore[arg-type]
    assert [c[0] for c in shell.commands] == ["install", "install"]  # homes only


async def test_finishes_an_attempt_cut_short() -> None:
    shell = FakeShell(group="root:x:0:\nalice:x:10001:\n")  # group made, user not
    assert await ensure_accounts(shell, [UnixUser("alice", 10001)]) == ["alice"]  # type: ignore[arg-type]
    assert [c[0] for c in shell.commands] == ["useradd", "install"]


async def test_refuses_to_hand_over_another_uid() -> None:
    shell = FakeShell(passwd="alice:x:2000:2000::/home/alice:/bin/bash\n")
    with pytest.raises(PermanentLayerError, match="uid 2000"):
        await ensure_accounts(shell, [UnixUser("alice", 10001)])  # type: ignore[arg-type]
    shell = FakeShell(group="alice:x:2000:\n")
    with pytest.raises(PermanentLayerError, match="gid 2000"):
        await ensure_accounts(shell, [UnixUser("alice", 10001)])  # type: ignore[arg-type]
