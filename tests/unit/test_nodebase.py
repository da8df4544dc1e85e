"""The node's own account files and /etc whiteouts (linux/nodebase.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuclusters.linux import nodebase

PASSWD = """root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
munge:x:106:111::/nonexistent:/usr/sbin/nologin
debian:x:1000:1000:Debian:/home/debian:/bin/bash
barslap:x:1001:1001::/home/barslap:/bin/sh
slurm:x:64030:64030::/nonexistent:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
GROUP = """root:x:0:
shadow:x:42:
sudo:x:27:debian,munge
munge:x:111:
debian:x:1000:
nogroup:x:65534:
"""


def test_node_accounts_keep_system_accounts_only_and_lock_them() -> None:
    files = nodebase.node_accounts(PASSWD, GROUP)
    users = [line.split(":")[0] for line in files["passwd"].splitlines()]
    assert users == ["root", "daemon", "munge", "slurm", "nobody"]
    groups = files["group"].splitlines()
    assert [g.split(":")[0] for g in groups] == ["root", "shadow", "sudo", "munge", "nogroup"]
    assert "sudo:x:27:munge" in groups  # a host login is no member of anything
    assert all(line.split(":")[1] == "*" for line in files["shadow"].splitlines())
    assert [line.split(":")[0] for line in files["shadow"].splitlines()] == users
    assert all(line.split(":")[1] == "!" for line in files["gshadow"].splitlines())


def test_prepare_etc_writes_accounts_whiteouts_and_keeps_the_nodes_own(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "ssh").mkdir(parents=True)
    (host / "passwd").write_text(PASSWD)
    (host / "group").write_text(GROUP)
    (host / "ssh" / "ssh_host_ed25519_key").write_text("secret")
    (host / "ssh" / "ssh_host_ed25519_key.pub").write_text("public")
    (host / "ssl" / "private").mkdir(parents=True)
    upper = tmp_path / "upper"
    nodebase.prepare_etc(upper, host_etc=host)
    assert "barslap" not in (upper / "passwd").read_text()
    assert stat.S_IMODE((upper / "shadow").stat().st_mode) == 0o640
    assert (upper / "shadow").stat().st_gid == 42
    for hidden in ("ssh/ssh_host_ed25519_key", "ssl/private"):
        st = (upper / hidden).lstat()
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0), hidden
    assert not (upper / "ssh" / "ssh_host_ed25519_key.pub").exists()
    assert not (upper / "mysql").exists()  # not on this host: nothing to hide
    assert os.getxattr(upper / "gpuclusters", "trusted.overlay.opaque") == b"y"
    # The node's own changes survive the next boot's preparation.
    (upper / "passwd").write_text(PASSWD)
    (upper / "ssl" / "private").unlink()
    (upper / "ssl" / "private").mkdir()
    nodebase.prepare_etc(upper, host_etc=host)
    assert "barslap" in (upper / "passwd").read_text()
    assert (upper / "ssl" / "private").is_dir()


def test_var_skeleton(tmp_path: Path) -> None:
    var = nodebase.ensure_var_skeleton(tmp_path / "var")
    assert stat.S_IMODE((var / "tmp").stat().st_mode) == 0o1777
    assert os.readlink(var / "run") == "/run"
    assert nodebase.ensure_var_skeleton(var) == var  # idempotent
