"""The caller's SSH keys, and the organization's SSH certificate authorities."""

from __future__ import annotations

from fastapi import APIRouter

from gpuclusters.core import models as api
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.services import ssh_keys, sshca

router = APIRouter(prefix="/v1")


@router.get("/ssh-keys", response_model=list[api.SshKey])
async def list_ssh_keys(session: SessionDep, principal: PrincipalDep) -> list[api.SshKey]:
    return await ssh_keys.list_keys(session, principal=principal)


@router.post("/ssh-keys", response_model=api.SshKey, status_code=201)
async def add_ssh_key(
    body: api.SshKeyCreate, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.SshKey:
    return await ssh_keys.add_key(session, rt=rt, principal=principal, body=body)


# ``path``: a fingerprint ("SHA256:" + base64) may contain "/".
@router.delete("/ssh-keys/{key:path}", status_code=204)
async def delete_ssh_key(
    key: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> None:
    await ssh_keys.delete_key(session, rt=rt, principal=principal, key_ref=key)


@router.get("/ssh-ca", response_model=api.SshCa)
async def ssh_ca(session: SessionDep, principal: PrincipalDep, rt: RuntimeDep) -> api.SshCa:
    return await sshca.ssh_ca(session, rt=rt, principal=principal)
