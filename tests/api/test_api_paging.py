"""Paged list endpoints: ``limit``, the cursor in ``X-Next-Cursor`` and
``Link``, a stable order while rows come and go, and the SDK following every
page."""

from __future__ import annotations

import httpx

from support.api import ApiHarness

P = "/v1/projects/default"


async def _pages(client: httpx.AsyncClient, path: str, limit: int) -> list[list[str]]:
    pages: list[list[str]] = []
    params: dict[str, str | int] = {"limit": limit}
    while True:
        r = await client.get(path, params=params)
        assert r.status_code == 200, r.text
        pages.append([item["name"] for item in r.json()])
        cursor = r.headers.get("X-Next-Cursor")
        if cursor is None:
            assert "Link" not in r.headers
            return pages
        assert 'rel="next"' in r.headers["Link"] and cursor in r.headers["Link"]
        params = {"limit": limit, "cursor": cursor}


async def test_lists_page_in_creation_order_without_gaps_or_repeats(api: ApiHarness) -> None:
    names = [f"p{i}" for i in range(5)]
    for name in names:
        r = await api.client.post(
            f"{P}/clusters", json={"name": name, "cluster_type": "kubernetes", "num_gpus": 8}
        )
        assert r.status_code == 201, r.text

    pages = await _pages(api.client, f"{P}/clusters", limit=2)
    assert pages == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    # One page holds them all: no cursor.
    assert await _pages(api.client, f"{P}/clusters", limit=1000) == [names]

    nodes = await _pages(api.client, f"{P}/nodes", limit=3)
    assert [len(p) for p in nodes] == [3, 2]
    flat = [n for p in nodes for n in p]
    assert len(set(flat)) == 5 and [n.split("-")[0] for n in flat] == names

    # A cursor stays valid while rows before and after it change.
    first = await api.client.get(f"{P}/clusters", params={"limit": 2})
    cursor = first.headers["X-Next-Cursor"]
    assert (await api.client.delete(f"{P}/clusters/p0")).status_code == 202
    r = await api.client.post(
        f"{P}/clusters", json={"name": "p5", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    rest = await api.client.get(f"{P}/clusters", params={"limit": 1000, "cursor": cursor})
    assert [c["name"] for c in rest.json()][:3] == ["p2", "p3", "p4"]


async def test_bad_limit_and_cursor_are_refused_naming_the_field(api: ApiHarness) -> None:
    for params, field in (
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
    ):
        for path in (f"{P}/clusters", f"{P}/nodes", f"{P}/events", "/v1/hosts"):
            r = await api.client.get(path, params=params)
            assert r.status_code == 422, (path, params, r.text)
            assert r.json()["field"] == field, r.json()


async def test_a_repeated_single_valued_query_parameter_is_refused(api: ApiHarness) -> None:
    # FastAPI would quietly keep the last value; the document says one value.
    r = await api.client.get("/v1/capacity", params=[("project", "default"), ("project", "x")])
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "project" and "only once" in r.json()["message"]
    r = await api.client.get(f"{P}/clusters", params=[("limit", 1), ("limit", 2)])
    assert r.status_code == 422 and r.json()["field"] == "limit", r.text
    # One value of each is fine.
    r = await api.client.get("/v1/capacity", params={"project": "default"})
    assert r.status_code == 200, r.text


async def test_hosts_page_in_join_order_and_one_can_be_read_alone(api: ApiHarness) -> None:
    everything = (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    assert len(everything) >= 3, "the harness fleet has a few hosts"
    names = [h["name"] for h in everything]
    pages = await _pages(api.client, "/v1/hosts", limit=2)
    assert [n for p in pages for n in p] == names
    assert all(len(p) == 2 for p in pages[:-1]) and 1 <= len(pages[-1]) <= 2
    # One host by name, as the list shows it (with the node on it, if any).
    r = await api.client.post(
        f"{P}/clusters", json={"name": "h", "cluster_type": "kubernetes", "num_gpus": 8}
    )
    assert r.status_code == 201, r.text
    await api.wait_cluster("h", {"ready"})
    (node,) = (await api.client.get(f"{P}/nodes", params={"cluster": "h"})).json()
    host = (await api.client.get(f"/v1/hosts/{node['host']}")).json()
    assert host["node"] == node["name"] and host["cluster"] == "h", host
    listed = {
        h["name"]: h for h in (await api.client.get("/v1/hosts", params={"limit": 1000})).json()
    }
    assert listed[node["host"]] == host
    r = await api.client.get("/v1/hosts/no-such-host")
    assert r.status_code == 404 and r.json()["field"] == "name", r.text


async def test_events_page_newest_first_without_gaps_or_repeats(api: ApiHarness) -> None:
    for name in ("e0", "e1"):
        r = await api.client.post(
            f"{P}/clusters", json={"name": name, "cluster_type": "kubernetes", "num_gpus": 16}
        )
        assert r.status_code == 201, r.text
        await api.wait_cluster(name, {"ready"})
    everything = (await api.client.get(f"{P}/events", params={"limit": 1000})).json()
    assert len(everything) >= 4, everything
    stamps = [e["timestamp"] for e in everything]
    assert stamps == sorted(stamps, reverse=True)
    key = [(e["node"], e["reason"]) for e in everything]
    assert len(set(key)) == len(key)
    seen: list[tuple[str, str]] = []
    params: dict[str, str | int] = {"limit": 3}
    while True:
        r = await api.client.get(f"{P}/events", params=params)
        assert r.status_code == 200, r.text
        assert len(r.json()) <= 3
        seen += [(e["node"], e["reason"]) for e in r.json()]
        cursor = r.headers.get("X-Next-Cursor")
        if cursor is None:
            break
        params = {"limit": 3, "cursor": cursor}
    assert seen == key
    # The filters page too: one cluster's events only.
    one = (await api.client.get(f"{P}/events", params={"cluster": "e1", "limit": 1})).json()
    assert len(one) == 1 and one[0]["cluster"] == "e1"
