"""Unauthenticated endpoints: liveness. (The server's metrics are in
``routers.metrics``, for the scrape token and organization admins.)"""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
