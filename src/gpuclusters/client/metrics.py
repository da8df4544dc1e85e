"""``client.metrics``: PromQL queries over the caller's projects' series
(answers in Prometheus' query API format, as Grafana and promtool read
them), and the scrape targets (organization admins)."""

from __future__ import annotations

from typing import Any

from gpuclusters.client._session import Session
from gpuclusters.client.errors import UnexpectedResponseError


class MetricsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def _answer(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        response = self._s.request("GET", path, params=params)
        body = response.json()
        if not isinstance(body, dict) or "data" not in body:
            raise UnexpectedResponseError(f"GET {path}: not a query answer")
        return body

    def query(
        self, expr: str, *, time: str | None = None, project: str | None = None
    ) -> dict[str, Any]:
        """An instant query (``time``: RFC 3339 or Unix seconds; default now);
        ``project`` narrows it to one of the caller's projects."""
        return self._answer("/v1/metrics/query", {"query": expr, "time": time, "project": project})

    def query_range(
        self,
        expr: str,
        *,
        start: str,
        end: str | None = None,
        step: str | None = None,
        project: str | None = None,
    ) -> dict[str, Any]:
        """A range query from ``start`` to ``end`` (default now) every ``step``."""
        params = {"query": expr, "start": start, "end": end, "step": step, "project": project}
        return self._answer("/v1/metrics/query_range", params)

    def targets(self) -> list[dict[str, Any]]:
        """The node agents the metrics database scrapes (organization admins)."""
        data = self._s.request("GET", "/v1/metrics/targets").json()
        if not isinstance(data, list):
            raise UnexpectedResponseError("GET /v1/metrics/targets: expected a JSON array")
        return data
