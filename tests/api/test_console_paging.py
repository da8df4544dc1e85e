"""The console's long lists come a page at a time: the overview shows each
project's first clusters with a link to the next ones, the fleet page a page
of hosts with a link to the next page. Served in-process and read as HTML
(the browser tests in tests/e2e/test_console.py drive the rest)."""

from __future__ import annotations

import contextlib
import html
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from gpuclusters.server.routers import console
from support.api import ApiHarness

P = "/v1/projects/default"


@contextlib.asynccontextmanager
async def _signed_in(api: ApiHarness) -> AsyncIterator[httpx.AsyncClient]:
    """A browser-like client: the console's session cookie, no API key."""
    transport = httpx.ASGITransport(app=api.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        r = await client.post("/login", data={"api_key": api.admin_key})
        assert r.status_code == 303, r.text
        yield client


def _attr_values(page: str, attr: str) -> list[str]:
    return re.findall(rf'{attr}="([^"]+)"', page)


def _link(page: str, pattern: str) -> str | None:
    found = re.search(pattern, page)
    return html.unescape(found.group(1)) if found else None


async def test_overview_pages_a_projects_clusters(
    api: ApiHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console, "OVERVIEW_CLUSTERS", 2)
    names = ["p0", "p1", "p2"]
    for name in names:
        r = await api.client.post(
            f"{P}/clusters", json={"name": name, "cluster_type": "kubernetes", "num_gpus": 8}
        )
        assert r.status_code == 201, r.text
    async with _signed_in(api) as browser:
        first = (await browser.get("/")).text
        assert _attr_values(first, "data-cluster") == ["p0", "p1"]
        more = _link(first, r'class="more-clusters" data-project="default" href="([^"]+)"')
        assert more is not None and more.startswith("/?project=default&cursor=")

        second = (await browser.get(more)).text
        assert _attr_values(second, "data-cluster") == ["p2"]
        assert "more-clusters" not in second
        # The live part polls this very page, not the first one.
        assert _link(second, r'id="overview" hx-get="([^"]+)"') == more
        assert 'id="all-projects" href="/"' in second

        # One project's first page, as its poll URL asks for it.
        r = await browser.get("/", params={"project": "default", "cursor": ""})
        assert _attr_values(r.text, "data-cluster") == ["p0", "p1"]


async def test_fleet_page_pages_the_hosts(api: ApiHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "FLEET_HOSTS", 2)
    every = await api.client.get("/v1/hosts", params={"limit": 1000})
    assert every.status_code == 200, every.text
    expected = [h["name"] for h in every.json()]
    assert len(expected) > 2, "the fake fleet should need more than one page here"

    seen: list[str] = []
    async with _signed_in(api) as browser:
        url: str | None = "/fleet"
        while url is not None:
            r = await browser.get(url)
            assert r.status_code == 200, r.text
            hosts = _attr_values(r.text, "data-host")
            assert 1 <= len(hosts) <= 2
            seen.extend(hosts)
            url = _link(r.text, r'id="next-hosts" href="([^"]+)"')
    assert seen == expected
