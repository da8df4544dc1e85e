"""``RemoteShell``: the ``core.nodeshell.NodeShell`` of a node on another
host, every call one request to that host's agent (which runs it through
the node's ``NamespaceShell`` there)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from gpuclusters.core.nodeshell import CommandResult, NodeCommandError
from gpuclusters.providers.hosts import wire
from gpuclusters.providers.hosts.agent_client import AgentClient


class RemoteShell:
    def __init__(
        self,
        client: AgentClient,
        node_id: str,
        *,
        hostname: str,
        address: str,
        enter: list[str],
        python: str,
    ) -> None:
        self._client = client
        self._node_id = node_id
        self._hostname = hostname
        self._address = address
        self._enter = enter
        self._python = python

    @property
    def hostname(self) -> str:
        return self._hostname

    @property
    def address(self) -> str:
        return self._address

    @property
    def python(self) -> str:
        return self._python

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
        out = await self._client.run(
            self._node_id,
            wire.Run(
                argv=list(argv),
                user=user,
                env=dict(env) if env is not None else None,
                stdin=wire.b64(stdin) if stdin is not None else None,
                timeout_s=timeout_s,
            ),
        )
        result = CommandResult(
            returncode=out.returncode,
            stdout=wire.unb64(out.stdout).decode("utf-8", "replace"),
            stderr=wire.unb64(out.stderr).decode("utf-8", "replace"),
        )
        if check and result.returncode != 0:
            raise NodeCommandError(self._hostname, argv, result)
        return result

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        body = wire.Spawn(name=name, argv=list(argv), env=dict(env) if env is not None else None)
        await self._client.spawn(self._node_id, body)

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        await self._client.stop(self._node_id, wire.Stop(name=name, timeout_s=timeout_s))

    async def is_running(self, name: str) -> bool:
        return await self._client.is_running(self._node_id, name)

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        body = wire.WriteFile(path=path, data=wire.b64(data), mode=mode, owner=owner)
        return await self._client.write_file(self._node_id, body)

    async def read_file(self, path: str) -> bytes | None:
        return await self._client.read_file(self._node_id, path)

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        # An operator's terminal on a node of another host: root SSH to the
        # host (the access `gpuclusters hosts add` used), then the same
        # nsenter line the agent would run.
        inner = [*self._enter, *(["runuser", "-u", user, "--"] if user else []), *argv]
        return ["ssh", "-t", f"root@{self._client.address}", "--", shlex.join(inner)]
