"""Host id blocks: ranges, the start's rules and the host's own ranges."""

from __future__ import annotations

import pytest

from gpuclusters.core import idblocks
from gpuclusters.core.idblocks import BLOCK_SIZE, IdBlockError
from gpuclusters.server.settings import Settings


def test_blocks_are_disjoint_and_map_node_ids() -> None:
    a, b = idblocks.block(0), idblocks.block(1)
    assert a.last + 1 == b.first and not a.overlaps(b.first, b.last)
    assert a.host_id(0) == idblocks.DEFAULT_START
    assert b.host_id(10001) == idblocks.DEFAULT_START + BLOCK_SIZE + 10001
    with pytest.raises(IdBlockError, match="outside a node's range"):
        a.host_id(BLOCK_SIZE)


def test_next_index_never_reuses() -> None:
    assert idblocks.next_index([]) == 0
    assert idblocks.next_index([None]) == 0
    assert idblocks.next_index([0, 4, 2]) == 5


def test_the_last_block_fits_below_the_largest_id() -> None:
    n = idblocks.max_blocks(idblocks.DEFAULT_START)
    assert idblocks.block(n - 1).last <= idblocks.MAX_ID
    with pytest.raises(IdBlockError, match="out of range"):
        idblocks.block(n)


@pytest.mark.parametrize(
    ("start", "rule"),
    [(1000, "multiple of 65536"), (65536, "131072 or above"), (1 << 32, "at or below")],
)
def test_start_rules(start: int, rule: str) -> None:
    with pytest.raises(IdBlockError, match=rule):
        idblocks.check_start(start)
    with pytest.raises(ValueError, match="id_blocks_start"):
        Settings(id_blocks_start=start)


def test_host_ranges() -> None:
    sub = idblocks.parse_subordinate("alice:100000:65536\nbad line\nbob:x:1\nop:1073741824:10\n")
    assert sub == [(100000, 165535), (1073741824, 1073741833)]
    ids = idblocks.parse_passwd_ids(
        "root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    )
    assert ids == [0, 65534]
    idblocks.check_host_ranges(idblocks.DEFAULT_START, 10, [(0, 0), (100000, 165535)])
    with pytest.raises(IdBlockError, match="1073741824-1073741833 are in use"):
        idblocks.check_host_ranges(idblocks.DEFAULT_START, 10, sub)
