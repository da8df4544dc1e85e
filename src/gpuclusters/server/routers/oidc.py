"""The server as the issuer of users' Kubernetes tokens: its discovery
document and keys (``security/cluster_tokens.py``). Public: apiservers read
them without credentials, on the listener nodes may reach."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gpuclusters.core.errors import NotFoundError
from gpuclusters.server.deps import RuntimeDep
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.cluster_tokens import DISCOVERY_PATH, JWKS_PATH, TokenIssuer

router = APIRouter()


def _issuer(rt: Runtime) -> TokenIssuer:
    if rt.token_issuer is None:
        raise NotFoundError("this server signs no Kubernetes tokens (it serves no TLS)")
    return rt.token_issuer


@router.get(DISCOVERY_PATH, include_in_schema=False)
async def discovery(request: Request, rt: RuntimeDep) -> dict[str, Any]:
    return _issuer(rt).discovery(str(request.base_url))


@router.get(JWKS_PATH, include_in_schema=False)
async def jwks(rt: RuntimeDep) -> dict[str, Any]:
    return _issuer(rt).jwks()
