"""Waiting on real readiness signals, shared by the layers' steps.

Every wait polls a probe with a short backoff and gives up with a
``LayerError`` (transient: the control plane retries the step later);
there are no fixed sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.base import LayerError

T = TypeVar("T")


async def poll_until(
    probe: Callable[[], Awaitable[T | None]],
    *,
    timeout_s: float,
    first_delay_s: float = 0.02,
    max_delay_s: float = 0.05,
) -> T | None:
    """Call ``probe`` until it returns something other than None (backoff
    x1.5), or return None after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = first_delay_s
    while True:
        result = await probe()
        if result is not None:
            return result
        left = deadline - loop.time()
        if left <= 0:
            return None
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 1.5, max_delay_s)


async def wait_for(
    probe: Callable[[], Awaitable[T | None]],
    *,
    what: str,
    timeout_s: float,
    first_delay_s: float = 0.02,
    max_delay_s: float = 0.05,
) -> T:
    """``poll_until``, giving up with a ``LayerError``."""
    result = await poll_until(
        probe, timeout_s=timeout_s, first_delay_s=first_delay_s, max_delay_s=max_delay_s
    )
    if result is None:
        raise LayerError(f"timed out after {timeout_s:.0f} s waiting for {what}")
    return result


async def ok(shell: NodeShell, argv: Sequence[str], timeout_s: float = 10.0) -> bool | None:
    """True when the command exits 0, None otherwise (a probe for ``wait_for``)."""
    result = await shell.run(argv, check=False, timeout_s=timeout_s)
    return True if result.returncode == 0 else None
