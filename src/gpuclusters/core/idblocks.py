"""Host id blocks: which host uids and gids a project's nodes run as.

Every node runs in its own user namespace (docs/security.md). Inside, ids
0-65535 are the node's ordinary ids: root, Debian's system accounts, the
project's users (10000 and up) and ``nobody``. On the host each of them is
``first + id`` for the node's project's block, so root in a node is an
unprivileged nobody on the host, and a file written on the shared volume
keeps the same host owner on every host, in every cluster of the project
and across re-attaching the volume.

A project's block is its index (recorded in the database, never reused)
times :data:`BLOCK_SIZE` above the configured start. The start must leave
the host's own ids alone: Debian hands out ids below 65536 and, by default,
subordinate ranges (``/etc/subuid``) from 100000 up; the default start,
2**30, is far above both, and :func:`check_host_ranges` refuses a start
whose blocks would meet a range the host uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BLOCK_SIZE = 65536
DEFAULT_START = 1 << 30
# The kernel's largest id is 2**32 - 2 (-1 means "no id"); blocks end below.
MAX_ID = (1 << 32) - 2
# Ids inside a node that belong to the project's users (tenancy's FIRST_UID
# up to the node's system ranges: 60000-64999 and nobody, 65534).
FIRST_USER_ID = 10000
LAST_USER_ID = 59999


class IdBlockError(ValueError):
    """A block start or index the rules refuse; the message says which rule."""


@dataclass(frozen=True, slots=True)
class IdBlock:
    """Host ids ``first`` to ``first + count - 1``; node id ``n`` is host
    id ``first + n``."""

    first: int
    count: int = BLOCK_SIZE

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def host_id(self, node_id: int) -> int:
        if not 0 <= node_id < self.count:
            raise IdBlockError(f"id {node_id} is outside a node's range 0-{self.count - 1}")
        return self.first + node_id

    def overlaps(self, first: int, last: int) -> bool:
        return first <= self.last and self.first <= last


def check_start(start: int) -> None:
    if start % BLOCK_SIZE:
        raise IdBlockError(f"the first block must start at a multiple of {BLOCK_SIZE}")
    if start < 2 * BLOCK_SIZE:
        raise IdBlockError(f"the first block must start at {2 * BLOCK_SIZE} or above")
    if start + BLOCK_SIZE - 1 > MAX_ID:
        raise IdBlockError(f"the first block must end at or below {MAX_ID}")


def max_blocks(start: int) -> int:
    return (MAX_ID + 1 - start) // BLOCK_SIZE


def block(index: int, start: int = DEFAULT_START) -> IdBlock:
    """The block of the project with this index."""
    if not 0 <= index < max_blocks(start):
        raise IdBlockError(
            f"block {index} is out of range: {max_blocks(start)} blocks fit above {start}"
        )
    return IdBlock(first=start + index * BLOCK_SIZE)


def next_index(used: Iterable[int | None]) -> int:
    """The index for a new project: one above every index ever given (a
    block is never handed out twice, even if its project's rows went)."""
    top = max((i for i in used if i is not None), default=-1)
    return top + 1


def parse_subordinate(text: str) -> list[tuple[int, int]]:
    """``/etc/subuid`` or ``/etc/subgid`` lines (``name:first:count``) as
    ``(first, last)`` ranges; malformed lines are skipped."""
    ranges = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        first, count = int(parts[1]), int(parts[2])
        if count > 0:
            ranges.append((first, first + count - 1))
    return ranges


def parse_passwd_ids(text: str) -> list[int]:
    """The uids (or gids) of ``/etc/passwd`` or ``/etc/group`` lines."""
    ids = []
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            ids.append(int(parts[2]))
    return ids


def check_host_ranges(start: int, count: int, used: Iterable[tuple[int, int]]) -> None:
    """Refuse blocks ``start`` .. ``start + count * BLOCK_SIZE - 1`` if any
    meets a range the host uses (its accounts, its subordinate ranges)."""
    end = start + count * BLOCK_SIZE - 1
    for first, last in used:
        if first <= end and start <= last:
            raise IdBlockError(
                f"ids {first}-{last} are in use on this host and inside the id blocks "
                f"{start}-{end}: choose another start (GPUCLUSTERS_ID_BLOCKS_START)"
            )
