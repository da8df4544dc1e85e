"""``GET /v1/tls/ca.pem``: the CA certificate users trust the API's TLS
listener with, unauthenticated (it is public, and a client that does not
trust the server yet has no reason to send it a key). ``gpuclusters login
--ca-fingerprint`` fetches it over an unverified connection and checks its
SHA-256 fingerprint against the one the operator handed out."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from gpuclusters.server.deps import RuntimeDep
from gpuclusters.server.security import tls

router = APIRouter(prefix="/v1/tls")


@router.get(
    "/ca.pem",
    response_class=PlainTextResponse,
    responses={404: {"description": "TLS is off, or no CA to hand out"}},
)
def ca_pem(rt: RuntimeDep) -> PlainTextResponse:
    """The CA certificate (PEM); ``not_found`` when TLS is off or an operator
    certificate comes without ``tls_ca_file``."""
    return PlainTextResponse(tls.read_served_ca(rt.settings))
