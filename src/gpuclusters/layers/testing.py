"""A cluster layer for tests of the code that drives layers (the reconcilers),
shipped beside the ``ClusterLayer`` contract as httpx ships its mock
transport: every method succeeds at once, like the no-op layer, unless a
test scripted it to answer otherwise or to raise; every call is recorded.

    layer = ScriptedLayer()
    layer.script("join_node", False, False, True)      # not yet, not yet, joined
    layer.script("remove_node", LayerError("scontrol: DNS SRV lookup failed"))
    layer.always("delete", LayerError("gone"))          # every call fails
    layer.script("ensure_control_plane", lambda: asyncio.sleep(9, True))  # blocks, then True
    ...
    assert layer.calls_to("remove_node") == ["n1"]
"""

from __future__ import annotations

import inspect
from collections import defaultdict, deque
from datetime import datetime

from gpuclusters.core.autoscale import ScaleSignals
from gpuclusters.layers.base import ClusterRef, NodeRef
from gpuclusters.layers.noop.layer import NoopLayer

_UNSET = object()


class ScriptedLayer(NoopLayer):
    def __init__(self) -> None:
        self._queued: dict[str, deque[object]] = defaultdict(deque)
        self._always: dict[str, object] = {}
        self.calls: list[tuple[str, str]] = []  # (method, node or cluster name)
        self.builds_message: str | None = None  # what waiting_for_builds says

    def script(self, method: str, *answers: object) -> None:
        """The next calls of ``method`` answer these, in order (an exception
        is raised); after them, the ``always`` answer or the default."""
        self._queued[method].extend(answers)

    def always(self, method: str, answer: object) -> None:
        self._always[method] = answer

    def calls_to(self, method: str) -> list[str]:
        return [who for name, who in self.calls if name == method]

    async def _answer(self, method: str, who: str, default: object) -> object:
        """The scripted answer: a value, an exception (raised), or a callable
        (called, and awaited if it returns an awaitable: a step that blocks)."""
        self.calls.append((method, who))
        queued = self._queued.get(method)
        answer = queued.popleft() if queued else self._always.get(method, _UNSET)
        if answer is _UNSET:
            return default
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            answer = answer()
            if inspect.isawaitable(answer):
                answer = await answer
        return answer

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        return bool(await self._answer("ensure_control_plane", cluster.name, True))

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        return bool(await self._answer("join_node", node.name, True))

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        await self._answer("cordon", node.name, None)

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        return bool(await self._answer("drain", node.name, True))

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        await self._answer("remove_node", node.name, None)

    async def delete(self, cluster: ClusterRef) -> None:
        await self._answer("delete", cluster.name, None)

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        await self._answer("preempt", node.name, None)

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        return bool(await self._answer("preemption_done", node.name, True))

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        answer = await self._answer("running_work", node.name, 0)
        assert isinstance(answer, int)
        return answer

    async def scale_signals(self, cluster: ClusterRef) -> ScaleSignals | None:
        answer = await self._answer("scale_signals", cluster.name, None)
        assert answer is None or isinstance(answer, ScaleSignals)
        return answer

    def waiting_for_builds(self) -> str | None:
        return self.builds_message
