"""Shifting a node's files into its id block, and the host's own ids."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuclusters.core.idblocks import IdBlock, IdBlockError
from gpuclusters.linux import userns

BLOCK = IdBlock(first=1 << 30)


def test_shift_moves_node_ids_into_the_block_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    f = tmp_path / "d" / "f"
    f.write_text("x")
    os.chown(f, 10001, 5)
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o4755)
    (tmp_path / "link").symlink_to("/nonexistent")
    changed = userns.shift_tree(tmp_path, BLOCK)
    assert changed == 5  # root dir, d, f, tool, link
    assert (f.stat().st_uid, f.stat().st_gid) == (BLOCK.first + 10001, BLOCK.first + 5)
    assert tool.stat().st_mode & 0o7777 == 0o4755  # chown cleared it; put back
    assert os.lstat(tmp_path / "link").st_uid == BLOCK.first
    # Owners in a block already stay: a second pass changes nothing.
    assert userns.shift_tree(tmp_path, BLOCK) == 0
    assert f.read_text() == "x"


def test_adopt_leaves_a_volume_already_in_a_block(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert userns.adopt(tmp_path, BLOCK) == 2
    other = IdBlock(first=(1 << 30) + 65536)
    assert userns.adopt(tmp_path, other) == 0
    assert (tmp_path / "f").stat().st_uid == BLOCK.first


def test_check_host_ids_refuses_a_block_the_host_uses(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (tmp_path / "group").write_text("root:x:0:\n")
    (tmp_path / "subuid").write_text("alice:100000:65536\n")
    userns.check_host_ids(etc=tmp_path)
    (tmp_path / "subgid").write_text(f"big:{(1 << 30) + 70000}:10\n")
    with pytest.raises(IdBlockError, match="in use on this host"):
        userns.check_host_ids(etc=tmp_path)


def test_the_setting_reaches_the_embedded_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuclusters.providers.registry import ProviderOptions, _netns_config
    from gpuclusters.server.settings import Settings

    monkeypatch.delenv("GPUCLUSTERS_NODE_USERNS", raising=False)
    settings = Settings(home=tmp_path)
    assert settings.node_userns is True  # the default: every node in its own
    opts = ProviderOptions(home=tmp_path, node_userns=settings.node_userns)
    assert _netns_config(opts, [], None).userns is True
    # An operator's way out (a kernel or file system without idmapped mounts).
    monkeypatch.setenv("GPUCLUSTERS_NODE_USERNS", "0")
    off = Settings(home=tmp_path)
    assert off.node_userns is False
    opts = ProviderOptions(home=tmp_path, node_userns=off.node_userns)
    assert _netns_config(opts, [], None).userns is False
