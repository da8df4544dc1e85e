"""``Hints.notify_and_settle``: a caller waits for a pass that began after
its change, not for one already under way (which may have read the
database before the change was committed)."""

from __future__ import annotations

import asyncio

from gpuclusters.server.controllers.hints import Hints

TOPIC = "access"


async def _worker(h: Hints, gate: asyncio.Event, seen: list[int], passes: list[int]) -> None:
    """A worker whose pass reads ``seen[0]`` (the 'database') when it begins
    and then waits for ``gate`` (a slow push to nodes)."""
    with h.worker(TOPIC):
        while True:
            with h.passing(TOPIC):
                passes.append(seen[0])
                await gate.wait()
                gate.clear()
            await h.wait(TOPIC, 3600)


def test_a_caller_waits_for_a_pass_that_began_after_its_change() -> None:
    async def main() -> None:
        h = Hints()
        gate = asyncio.Event()
        db = [0]
        passes: list[int] = []
        task = asyncio.create_task(_worker(h, gate, db, passes))
        await asyncio.sleep(0)
        assert passes == [0]  # the first pass is under way, it read 0
        db[0] = 1  # the caller commits its change
        settle = asyncio.create_task(h.notify_and_settle(TOPIC, 3600))
        await asyncio.sleep(0)
        gate.set()  # the pass under way ends: it did not see the change
        for _ in range(5):
            await asyncio.sleep(0)
        assert not settle.done()
        assert passes == [0, 1]  # the hint started a pass that reads 1
        gate.set()
        assert await settle is True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_no_worker_answers_at_once_and_a_stopped_worker_answers_its_waiters() -> None:
    async def main() -> None:
        h = Hints()
        assert await h.notify_and_settle(TOPIC, 3600) is False
        gate = asyncio.Event()
        task = asyncio.create_task(_worker(h, gate, [0], []))
        await asyncio.sleep(0)
        settle = asyncio.create_task(h.notify_and_settle(TOPIC, 3600))
        await asyncio.sleep(0)
        task.cancel()  # shutting down with a caller waiting
        await asyncio.gather(task, return_exceptions=True)
        assert await settle is False

    asyncio.run(main())


def test_the_wait_is_bounded() -> None:
    async def main() -> None:
        h = Hints()
        gate = asyncio.Event()  # never set: the pass hangs
        task = asyncio.create_task(_worker(h, gate, [0], []))
        await asyncio.sleep(0)
        assert await h.notify_and_settle(TOPIC, 0.05) is False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_access_changed_waits_for_the_sync_unless_told_not_to() -> None:
    """``services.access_changes``: with ``access_apply_wait_s`` the call
    returns once a pass after it has ended; with 0, at once (hint only)."""
    from types import SimpleNamespace
    from typing import cast

    from gpuclusters.server.runtime import Runtime
    from gpuclusters.server.services.access_changes import access_changed

    async def main() -> None:
        h = Hints()
        gate = asyncio.Event()
        task = asyncio.create_task(_worker(h, gate, [0], []))
        await asyncio.sleep(0)
        gate.set()  # the first pass ends
        await asyncio.sleep(0)

        def rt(wait_s: float) -> Runtime:
            settings = SimpleNamespace(access_apply_wait_s=wait_s)
            return cast(Runtime, SimpleNamespace(settings=settings, hints=h, node_access=None))

        assert await access_changed(rt(0)) is False  # hinted, not waited for
        # That hint's pass is under way; the next call waits for the pass after.
        waiting = asyncio.create_task(access_changed(rt(3600)))
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set()  # the pass that began before the call ends
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        gate.set()  # the pass that began after it ends
        assert await asyncio.wait_for(waiting, 10) is True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
