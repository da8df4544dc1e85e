"""A node provider for tests of the code that drives providers, shipped
beside the ``NodeProvider`` contract: instances are kept in memory, a
created node boots for ``boot_polls`` status calls, and any method can be
scripted to answer otherwise or to raise; every call is recorded.

    provider = ScriptedProvider(hosts=[HostSpec("h1", "H100_SXM", "r", "ib-a")])
    provider.script("create", ProviderError("host agent unreachable"))
    provider.always("delete", ProviderError("no route to host"))
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import ClassVar

from gpuclusters.providers.base import HostSpec, Instance, InstanceState, NodeProvider, NodeSpec

_UNSET = object()


class ScriptedProvider(NodeProvider):
    name: ClassVar[str] = "scripted"

    def __init__(self, *, hosts: list[HostSpec] | None = None, boot_polls: int = 0) -> None:
        self._hosts = list(hosts or [])
        self.boot_polls = boot_polls
        self.instances: dict[str, Instance] = {}
        self._polls: dict[str, int] = {}
        self._queued: dict[str, deque[object]] = defaultdict(deque)
        self._always: dict[str, object] = {}
        self.calls: list[tuple[str, str]] = []  # (method, node id)

    def script(self, method: str, *answers: object) -> None:
        """The next calls of ``method`` answer these in order (an exception
        is raised, an ``Instance`` is returned as it is)."""
        self._queued[method].extend(answers)

    def always(self, method: str, answer: object) -> None:
        self._always[method] = answer

    def calls_to(self, method: str) -> list[str]:
        return [who for name, who in self.calls if name == method]

    def _scripted(self, method: str, who: str) -> object:
        self.calls.append((method, who))
        queued = self._queued.get(method)
        answer = queued.popleft() if queued else self._always.get(method, _UNSET)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def hosts(self) -> list[HostSpec]:
        return list(self._hosts)

    async def create(self, spec: NodeSpec) -> Instance:
        answer = self._scripted("create", spec.node_id)
        if isinstance(answer, Instance):
            return answer
        inst = self.instances.get(spec.node_id)
        if inst is None:
            inst = Instance(spec.node_id, spec.host, InstanceState.BOOTING)
            self.instances[spec.node_id] = inst
            self._polls[spec.node_id] = 0
        return inst

    async def status(self, node_id: str) -> Instance:
        answer = self._scripted("status", node_id)
        if isinstance(answer, Instance):
            return answer
        inst = self.instances.get(node_id)
        if inst is None:
            return Instance(node_id, "", InstanceState.MISSING)
        if inst.state is InstanceState.BOOTING:
            self._polls[node_id] += 1
            if self._polls[node_id] > self.boot_polls:
                inst = self.instances[node_id] = Instance(node_id, inst.host, InstanceState.RUNNING)
        return inst

    async def delete(self, node_id: str) -> None:
        self._scripted("delete", node_id)
        self.instances.pop(node_id, None)

    async def reboot(self, node_id: str) -> Instance:
        self._scripted("reboot", node_id)
        return await self.status(node_id)

    async def reprovision(self, node_id: str) -> Instance:
        self._scripted("reprovision", node_id)
        return await self.status(node_id)

    async def list_instances(self) -> list[Instance]:
        return list(self.instances.values())
